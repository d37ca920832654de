"""A "dns:" target as the servers behind it: the name's every address (all
A and AAAA records, without duplicates; a StatefulSet's pods in ordinal
order when reverse DNS names them), one server each, as the C++ client
resolves it (client/target_resolver.h, client/push_targets.h).

    parse_dns_target("dns:///detlogp.ns.svc:50051")  # ("detlogp.ns.svc", "50051")
    resolve_with_getaddrinfo("detlogp.ns.svc", "50051")
    # ["10.0.0.7:50051", "10.0.0.9:50051", "[fd00::3]:50051"]
    expand_targets(["dns:///detlogp.ns.svc:50051"])
    # [PushTarget("10.0.0.7:50051", "dns:///detlogp.ns.svc:50051", "detlogp.ns.svc"), ...]

A push uses it so that one upload to a Kubernetes headless Service stages
and commits on every pod (a gRPC "dns:" channel would reach one per call).
"""

import collections
import socket
import threading
import time

from detlogp.errors import Unavailable

# One server of a push: `target` names one server (an address the name
# resolved to, or a target as given); `resolved_from` the "dns:" target it
# came from ("" when given as is); `tls_name` the name its certificate must
# carry ("": the target's own).
PushTarget = collections.namedtuple("PushTarget", ("target", "resolved_from", "tls_name"))


def parse_dns_target(target):
    """(host, port) of a "dns:" target ("dns:///host:port", "dns:host:port"
    or "dns://authority/host:port"; IPv6 literals in brackets); None for a
    target of another scheme; ValueError for a "dns:" target without a host
    or port."""
    if not target.startswith("dns:"):
        return None
    rest = target[len("dns:") :]
    # "dns://authority/host:port": the authority names a DNS server; the
    # system's resolver is used whatever it says.
    if rest.startswith("//"):
        rest = rest[2:]
        slash = rest.find("/")
        if slash < 0:
            raise ValueError(f"target: {target} has no host:port after dns://authority/")
        rest = rest[slash + 1 :]
    if rest.startswith("["):
        close = rest.find("]")
        if close < 0:
            raise ValueError(f"target: {target} has an unclosed [ipv6] host")
        host = rest[1:close]
        colon = close + 1
        if colon >= len(rest) or rest[colon] != ":":
            colon = len(rest)
    else:
        colon = rest.rfind(":")
        if colon < 0:
            colon = len(rest)
        host = rest[:colon]
    port = rest[colon + 1 :]
    if not host or not port:
        raise ValueError(f"target: {target} needs a host and a port (dns:///host:port)")
    return host, port


def resolve_with_getaddrinfo(host, port):
    """Every A and AAAA record of `host` as gRPC targets ("ip:port",
    "[ipv6]:port"), sorted, without duplicates; Unavailable naming the host
    when it resolves to none."""
    try:
        found = socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except (OSError, UnicodeError) as error:
        raise Unavailable(f"target: {host}:{port} did not resolve: {error}") from None
    targets = set()
    for family, _, _, _, address in found:
        ip = address[0].split("%")[0]  # without an IPv6 scope, as inet_ntop gives it
        if family == socket.AF_INET:
            targets.add(f"{ip}:{port}")
        elif family == socket.AF_INET6:
            targets.add(f"[{ip}]:{port}")
    if not targets:
        raise Unavailable(f"target: {host}:{port} has no address")
    return sorted(targets)


def reverse_name(address):
    """The host name an address ("ip:port", "[ipv6]:port") has in reverse
    DNS; "" when it has none."""
    ip = address.rsplit(":", 1)[0]
    if ip.startswith("[") and ip.endswith("]"):
        ip = ip[1:-1]
    try:
        return socket.gethostbyaddr(ip)[0]
    except (OSError, UnicodeError):
        return ""


def in_pod_ordinal_order(addresses, reverse=reverse_name):
    """`addresses` in pod-ordinal order when every one's reverse name
    starts with "<set>-<ordinal>." for one <set> (a Kubernetes StatefulSet's
    pods behind a headless Service); otherwise unchanged."""
    addresses = list(addresses)
    if len(addresses) < 2:
        return addresses
    sets, by_ordinal = set(), []
    for address in addresses:
        label = reverse(address).split(".", 1)[0]
        prefix, dash, ordinal = label.rpartition("-")
        if not (dash and prefix and ordinal.isascii() and ordinal.isdigit()):
            return addresses  # not a StatefulSet's pod
        sets.add(prefix)
        by_ordinal.append((int(ordinal), address))
    ordinals = {ordinal for ordinal, _ in by_ordinal}
    if len(sets) != 1 or len(ordinals) != len(addresses):
        return addresses
    return [address for _, address in sorted(by_ordinal)]


def reverse_names_within(addresses, reverse=reverse_name, budget_s=2.0):
    """`reverse` of every address, side by side; when any lookup has not
    answered within `budget_s`, every name is "" (a resolver that does not
    answer cannot hold a push up for long; its lookups finish on their
    own, on daemon threads)."""
    names = [""] * len(addresses)
    answered = threading.Semaphore(0)

    def look_up(i, address):
        names[i] = reverse(address) or ""
        answered.release()

    for i, address in enumerate(addresses):
        threading.Thread(target=look_up, args=(i, address), daemon=True).start()
    deadline = time.monotonic() + budget_s
    for _ in addresses:
        if not answered.acquire(timeout=max(deadline - time.monotonic(), 0.0)):
            return [""] * len(addresses)
    return names


def resolve_in_pod_order(host, port):
    """resolve_with_getaddrinfo, then in_pod_ordinal_order with the names
    reverse_names_within finds in 2 s: the servers a push reaches through a
    "dns:" name, in the order it chains them."""
    addresses = resolve_with_getaddrinfo(host, port)
    if len(addresses) < 2:
        return addresses
    names = dict(zip(addresses, reverse_names_within(addresses)))
    return in_pod_ordinal_order(addresses, names.get)


def expand_targets(targets, resolver=None):
    """[PushTarget]: every target in the order given, a "dns:" target
    replaced in its place by its addresses (`resolver(host, port)`, None:
    resolve_in_pod_order); a server met twice is kept once. ValueError
    for a malformed "dns:" target; Unavailable naming a "dns:" target that
    resolves to no address."""
    resolve = resolver or resolve_in_pod_order
    out = []
    seen = set()
    for target in targets:
        name = parse_dns_target(target)
        if name is None:
            found = [PushTarget(target, "", "")]
        else:
            try:
                addresses = list(resolve(*name))
            except Unavailable as error:
                addresses, why = [], error.details
            else:
                why = "no address"
            if not addresses:
                raise Unavailable(f"push: {target} resolves to no server ({why})")
            found = [PushTarget(address, target, name[0]) for address in addresses]
        for pushed in found:
            if pushed.target not in seen:
                seen.add(pushed.target)
                out.append(pushed)
    return out
