"""compute-sanitizer memcheck over GPU gtests, as Bazel tests tagged "gpu".

The full-vocabulary cases are too slow under the tool, so each run names
the small shapes it covers (MEMCHECK_FILTERS). memcheck_tests() makes one
test per entry, <binary>_memcheck, and memcheck.json (the same filters) for
the device bundle, whose suites run the tool without Bazel.
"""

MEMCHECK_FILTERS = {
    "linear_logp_cuda_test": ":".join([
        "Edges/ShapeTest.*/V63_*",
        "Edges/ShapeTest.*/V64_*",
        "Edges/ShapeTest.*/V65_*",
        "Edges/ShapeTest.*/V1_*",
        "Edges/ShapeTest.*/V129_*",
        "Edges/ShapeTest.*/V2049_*",
        "Edges/ShapeTest.*/V4097_*",
        "Edges/ShapeTest.*/V8191_*",
        "LinearLogpCudaValidation.*",
        "LinearLogpCudaExtras.RejectsBadTopK",
        "LinearLogpCudaExtras.SmallVocabulariesAndPadding",
    ]),
    "linear_logp_portable_test": ":".join([
        "LinearLogpPortableVersion.*",
        "Edges/PortableShapeTest.*/V1_*",
        "Edges/PortableShapeTest.*/V63_*",
        "Edges/PortableShapeTest.*/V65_*H64*",
        "LinearLogpPortableInputs.*",
        "LinearLogpPortableExtras.RejectsBadTopK",
        "LinearLogpPortableExtras.SmallVocabulariesAndPadding",
    ]),
}

def memcheck_tests():
    """<binary>_memcheck for each MEMCHECK_FILTERS entry (tagged "gpu" and
    "manual": CI neither runs nor builds them), and :memcheck_json."""
    for binary, gtest_filter in MEMCHECK_FILTERS.items():
        native.sh_test(
            name = binary + "_memcheck",
            size = "large",
            srcs = ["memcheck.sh"],
            args = ["$(rootpath :%s)" % binary, "--gtest_filter=" + gtest_filter],
            data = [":" + binary],
            tags = ["gpu", "manual"],
        )
    native.genrule(
        name = "memcheck_json",
        outs = ["memcheck.json"],
        cmd = "echo '%s' > $@" % json.encode(MEMCHECK_FILTERS),
    )
