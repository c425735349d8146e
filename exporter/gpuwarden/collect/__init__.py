"""Collection: reading NVML per domain and tier, and publishing each GPU's readings as a snapshot.

Collection: readers per domain, worker threads, tiers, NVML lifecycle, the poller, snapshot assembly, XID events
and topology."""
