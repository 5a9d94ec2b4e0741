"""Regenerate this package's modules from envd's protos, as the installed ``e2b`` SDK
describes them (the serialized descriptors in its generated modules: the SDK ships no
``.proto`` files).

Needs the code generators (``pip install protoc-gen-py==0.6.0
protoc-gen-connectrpc==0.12.1``, the versions of ``protobuf-py`` and ``connectrpc`` the
project uses); no ``protoc``: the plugins are fed a ``CodeGeneratorRequest`` made here.
Run ``python -m metasched.serve.e2b.envd.regenerate``.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import shutil
import subprocess
import sys

from protobuf.wkt.google.protobuf import timestamp_pb
from protobuf.wkt.google.protobuf.compiler.plugin_pb import (
    CodeGeneratorRequest,
    CodeGeneratorResponse,
)
from protobuf.wkt.google.protobuf.descriptor_pb import FileDescriptorProto

HERE = pathlib.Path(__file__).parent
PROTOS = {"process/process_pb.py": "process", "filesystem/filesystem_pb.py": "filesystem"}


def descriptor(path: pathlib.Path) -> FileDescriptorProto:
    """The file descriptor a generated ``*_pb.py`` module was made from."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "file_desc":
            return FileDescriptorProto.from_binary(node.args[0].value)
    raise SystemExit(f"{path}: no file_desc(...) call (not a protoc-gen-py module)")


def main() -> None:
    spec = importlib.util.find_spec("e2b.envd")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the e2b package is not installed (pip install e2b)")
    envd = pathlib.Path(next(iter(spec.submodule_search_locations)))
    files = [descriptor(envd / rel) for rel in PROTOS]
    request = CodeGeneratorRequest(
        file_to_generate=[f.name for f in files],
        proto_file=[descriptor(pathlib.Path(timestamp_pb.__file__)), *files])
    for plugin in ("protoc-gen-py", "protoc-gen-connectrpc"):
        exe = shutil.which(plugin) or str(pathlib.Path(sys.executable).parent / plugin)
        out = subprocess.run([exe], input=request.to_binary(), capture_output=True,
                             check=True)
        response = CodeGeneratorResponse.from_binary(out.stdout)
        if response.error:
            raise SystemExit(f"{plugin}: {response.error}")
        for f in response.file:
            name = pathlib.Path(f.name).name
            if name != "__init__.py":
                (HERE / name).write_text(f.content.replace(
                    ".proto. DO NOT EDIT.", ".proto (envd). DO NOT EDIT.", 1))
                print(HERE / name)


if __name__ == "__main__":
    main()
