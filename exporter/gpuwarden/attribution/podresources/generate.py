"""Regenerate podresources_pb2.py from podresources.proto (needs grpcio-tools, a test extra).

The generated module is committed so the exporter needs only the protobuf runtime; tests/test_podresources.py
fails when it no longer matches the .proto.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).parent


def generate(out_dir: Path) -> Path:
    from grpc_tools import protoc

    code = protoc.main(["protoc", f"-I{HERE}", f"--python_out={out_dir}", str(HERE / "podresources.proto")])
    if code != 0:
        raise RuntimeError(f"protoc exited with {code}")
    return out_dir / "podresources_pb2.py"


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        (HERE / "podresources_pb2.py").write_text(generated.read_text())
    print("wrote", HERE / "podresources_pb2.py", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
