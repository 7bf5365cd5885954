"""Checks that modules of every layer share: an int argument in a range, an optional dependency.

Both raise what the public API documents: ``TypeError``/``ValueError`` naming
the argument (docs/api.md), and :class:`~dedupcore.errors.MissingExtraError`
naming the extra to install (docs/compatibility.md, "Installing").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from dedupcore.errors import MissingExtraError

__all__ = ["checked_int", "extra_imports"]


def checked_int(name: str, value: object, low: int, high: int, span: str = "") -> int:
    """``value`` if it is an int in ``low..high``, else TypeError (a bool too) or ValueError
    (naming the range as ``span`` when given, such as ``1..2**63-1``)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if not low <= value <= high:
        raise ValueError(f"{name} must be in {span or f'{low}..{high}'}, got {value}")
    return value


@contextmanager
def extra_imports(
    module: str, extra: str, needed_by: str, *, also: tuple[str, ...] = ()
) -> Iterator[None]:
    """Around the imports from an optional dependency: MissingExtraError naming ``extra``
    when ``module`` is not installed.

    ``with extra_imports("celery", "celery", "dedupcore.integrations.celery"):`` followed
    by the ``import``/``from`` lines of that dependency, in the module's import section.
    Only the absence of ``module`` itself (or of one of ``also``, modules installed with
    it) is turned into MissingExtraError (``needed_by`` names the part of dedupcore that
    needs it); an import that fails inside an installed ``module`` raises as it is.
    """
    try:
        yield
    except ModuleNotFoundError as exc:
        if exc.name != module and exc.name not in also:
            raise
        raise MissingExtraError(
            f"{needed_by} needs {module}, which is not installed: pip install 'dedupcore[{extra}]'"
        ) from exc
