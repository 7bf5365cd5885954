"""Every view at /NAME, and decorated at /view/NAME."""

from django.urls import path

from . import views

urlpatterns = [
    path("health", views.health),
    path("orders", views.orders),
    path("aorders", views.aorders),
    path("flaky", views.flaky),
    path("reject", views.reject),
    path("big", views.big),
    path("stream", views.stream),
    path("view/orders", views.view_orders),
    path("view/aorders", views.view_aorders),
    path("view/flaky", views.view_flaky),
    path("view/required", views.required_orders),
    path("plain", views.effect),
    path("ledger", views.effect),
    path("view/plain", views.view_effect),
    path("view/ledger", views.view_effect),
]
