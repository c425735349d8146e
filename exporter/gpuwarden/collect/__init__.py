"""Collection: readers per domain, worker threads, tiers, NVML lifecycle, the poller, snapshot assembly, XID events
and topology."""
