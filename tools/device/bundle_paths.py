"""Where tools/device/bundle.sh put the libraries the benchmarks load.

The scripts run from the bundle (its scripts/ folder) or from the tree
(tools/device, the bundle in .device/bundle); DETLOGP_BUNDLE names another.
"""

import os


def bundle_dir():
    """The bundle's root folder."""
    if os.environ.get("DETLOGP_BUNDLE"):
        return os.environ["DETLOGP_BUNDLE"]
    here = os.path.dirname(os.path.abspath(__file__))
    parent = os.path.dirname(here)
    if os.path.basename(here) == "scripts" and os.path.isdir(os.path.join(parent, "lib")):
        return parent
    return os.path.join(os.path.dirname(parent), ".device", "bundle")


def bundle_lib(name):
    """The path of the bundle's library `name` (e.g. liblogp_bench.so)."""
    return os.path.join(bundle_dir(), "lib", name)
