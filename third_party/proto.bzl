"""C++ protobuf + gRPC code from Debian's protoc and grpc_cpp_plugin."""

def cc_grpc_library(name, proto, proto_root, deps = [], **kwargs):
    """Generates and compiles <proto>.pb.* and <proto>.grpc.pb.*.

    Args:
      name: cc_library name.
      proto: the .proto file, relative to this package.
      proto_root: the import root, relative to this package ("." if none).
      deps: extra cc deps.
      **kwargs: passed to cc_library.
    """
    stem = proto[:-len(".proto")]
    outs = [stem + suffix for suffix in [".pb.h", ".pb.cc", ".grpc.pb.h", ".grpc.pb.cc"]]
    package = native.package_name()
    root = package if proto_root == "." else package + "/" + proto_root
    native.genrule(
        name = name + "_gen",
        srcs = [proto],
        outs = outs,
        cmd = ("protoc --proto_path={root} --cpp_out=$(GENDIR)/{root} " +
               "--grpc_out=$(GENDIR)/{root} " +
               "--plugin=protoc-gen-grpc=$$(command -v grpc_cpp_plugin) " +
               "$(location {proto})").format(root = root, proto = proto),
    )
    native.cc_library(
        name = name,
        srcs = [o for o in outs if o.endswith(".cc")],
        hdrs = [o for o in outs if o.endswith(".h")],
        includes = [proto_root],
        deps = deps + ["//third_party:grpc"],
        **kwargs
    )
