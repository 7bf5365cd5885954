"""Storage tiers behind a DedupStore."""
