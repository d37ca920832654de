"""compute-sanitizer memcheck over GPU gtests, as Bazel tests tagged "gpu".

The full-vocabulary cases are too slow under the tool, so each run names
the small shapes it covers (MEMCHECK_FILTERS). memcheck_test() makes the
Bazel test over one binary, memcheck_json() the same filters as
memcheck.json for the device bundle, whose suites run the tool without
Bazel.
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

def memcheck_test(name, binary):
    """compute-sanitizer memcheck over `binary`'s MEMCHECK_FILTERS cases,
    tagged "gpu" and "manual" (CI neither runs nor builds it)."""
    native.sh_test(
        name = name,
        size = "large",
        srcs = ["memcheck.sh"],
        args = ["$(rootpath :%s)" % binary, "--gtest_filter=" + MEMCHECK_FILTERS[binary]],
        data = [":" + binary],
        tags = ["gpu", "manual"],
    )

def memcheck_json(name):
    """memcheck.json: MEMCHECK_FILTERS, for the device bundle."""
    native.genrule(
        name = name,
        outs = ["memcheck.json"],
        cmd = "echo '%s' > $@" % json.encode(MEMCHECK_FILTERS),
    )
