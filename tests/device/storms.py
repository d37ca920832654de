"""What cancellation storms (detlogp.loadgen.cancellation_storm) may end
in, and what the server's process holds in memory between them."""


def unexpected_outcomes(counts):
    """Outcomes other than answered or cancelled by the caller."""
    return {
        k: v
        for k, v in counts.items()
        if k.startswith(("unary_", "stream_"))
        and not k.endswith(("_ok", "_cancelled", "_CANCELLED"))
    }


def process_memory_kib(pid):
    """VmRSS and its parts (RssAnon: heap and anonymous maps; RssFile:
    mapped files and libraries; RssShmem), KiB, from /proc/PID/status."""
    found = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                found[key] = int(value.split()[0])
    return found


def last_third_growth(rss):
    """(growth, start, peak): the largest RSS over the last third of the
    storms against the RSS after the storm just before that third, as a
    fraction of the latter."""
    third = max(1, len(rss) // 3)
    start = rss[-third - 1]
    peak = max(rss[-third:])
    return (peak - start) / start, start, peak
