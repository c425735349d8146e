"""Who holds a GPU: processes, the host's /proc, and the kubelet's pod resources."""
