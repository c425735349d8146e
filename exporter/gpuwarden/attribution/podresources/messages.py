"""The kubelet pod-resources API's message classes, built at import from the compiled descriptor.

podresources.binpb is podresources.proto compiled (generate.py writes it); protobuf's runtime builds the classes from
it, so no generated code is kept and any protobuf runtime of the declared range reads it.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import descriptor_pool, message_factory

DESCRIPTOR = descriptor_pool.Default().AddSerializedFile(Path(__file__).with_name("podresources.binpb").read_bytes())
globals().update(
    {name: message_factory.GetMessageClass(message) for name, message in DESCRIPTOR.message_types_by_name.items()}
)
