"""The snapshot contract and the metric families every consumer shares."""
