"""A fake kubelet: the real gRPC pod-resources List service on a unix socket, answering what a test sets."""

from __future__ import annotations

from concurrent import futures
from pathlib import Path

import grpc

from gpuwarden.attribution.podresources import messages as pb

GPU = "nvidia.com/gpu"


class FakeKubelet:
    """A PodResourcesLister on a unix socket; `pods` is what List answers, changeable while it runs."""

    def __init__(self, socket_path: Path) -> None:
        self.socket_path = socket_path
        self.pods: list[tuple[str, str, list[tuple[str, list[tuple[str, list[str]]]]]]] = []
        # DRA allocations (Kubernetes 1.34+): (namespace, pod, container, claim, [(driver, pool, device), ...])
        self.claims: list[tuple[str, str, str, str, list[tuple[str, str, str]]]] = []
        self.calls = 0
        self.server: grpc.Server | None = None

    def _list(self, request: pb.ListPodResourcesRequest, context: grpc.ServicerContext) -> pb.ListPodResourcesResponse:
        self.calls += 1
        response = pb.ListPodResourcesResponse()
        for namespace, name, containers in self.pods:
            pod = response.pod_resources.add(name=name, namespace=namespace)
            for container_name, devices in containers:
                container = pod.containers.add(name=container_name)
                for resource, ids in devices:
                    container.devices.add(resource_name=resource, device_ids=ids)
        for namespace, name, container_name, claim_name, devices in self.claims:
            pod = next((p for p in response.pod_resources if (p.namespace, p.name) == (namespace, name)), None)
            pod = pod or response.pod_resources.add(name=name, namespace=namespace)
            container = next((c for c in pod.containers if c.name == container_name), None)
            container = container or pod.containers.add(name=container_name)
            claim = container.dynamic_resources.add(claim_name=claim_name, claim_namespace=namespace)
            for driver, pool, device in devices:
                resource = claim.claim_resources.add(driver_name=driver, pool_name=pool, device_name=device)
                resource.cdi_devices.add(name=f"k8s.gpu.nvidia.com/claim={claim_name}-{device}")
        return response

    def start(self) -> FakeKubelet:
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        handler = grpc.method_handlers_generic_handler(
            "v1.PodResourcesLister",
            {
                "List": grpc.unary_unary_rpc_method_handler(
                    self._list,
                    request_deserializer=pb.ListPodResourcesRequest.FromString,
                    response_serializer=pb.ListPodResourcesResponse.SerializeToString,
                )
            },
        )
        self.server.add_generic_rpc_handlers((handler,))
        self.server.add_insecure_port(f"unix://{self.socket_path}")
        self.server.start()
        return self

    def stop(self) -> None:
        if self.server is not None:
            self.server.stop(grace=None).wait()
            self.server = None
        self.socket_path.unlink(missing_ok=True)
