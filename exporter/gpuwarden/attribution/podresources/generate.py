"""Regenerate podresources.binpb, the compiled descriptor of podresources.proto (needs grpcio-tools, a test extra).

The descriptor is committed so the exporter needs only the protobuf runtime, which builds the message classes from
it (messages.py); tests/test_podresources.py fails when it no longer matches the .proto.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent
DESCRIPTOR_FILE = HERE / "podresources.binpb"


def compile_proto(out_dir: Path) -> bytes:
    """The .proto's FileDescriptorProto, serialized, as protoc compiles it (without the JSON names, which the
    protobuf runtime derives)."""
    from google.protobuf import descriptor_pb2
    from grpc_tools import protoc

    out = out_dir / "set.binpb"
    code = protoc.main(["protoc", f"-I{HERE}", f"--descriptor_set_out={out}", str(HERE / "podresources.proto")])
    if code != 0:
        raise RuntimeError(f"protoc exited with {code}")
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in compiled.message_type:
        for field in message.field:
            field.ClearField("json_name")
    return compiled.SerializeToString()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        DESCRIPTOR_FILE.write_bytes(compile_proto(Path(tmp)))
    print("wrote", DESCRIPTOR_FILE, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
