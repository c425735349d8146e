"""ECC, remapped rows, retired pages, field values, NVLink and topology: the health and interconnect symbols."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pynvml

from gpuwarden.sim.fakecommon import (
    _LEVELS,
    _NVLINK_CRC_DATA,
    _NVLINK_ECC,
    _NVSWITCH_BUS,
    _THROTTLE_FIELD_BITS,
    _UINT,
    _ULL,
    OK,
    _out,
    _val,
)

# Fields read from one value of the GPU: field id → (value type, value) of (the fake library, GPU index). A table built
# once: each of the field reads a fast cycle makes used to build it afresh.
_SIMPLE_FIELDS: dict[int, Callable[[Any, int], tuple[int, float]]] = {
    82: lambda fake, i: (_UINT, fake._value(i, "memory_temperature")),
    83: lambda fake, i: (_ULL, fake._energy_mj[i]),
    91: lambda fake, i: (_UINT, fake.model.nvlinks),
    94: lambda fake, i: (_UINT, fake._events("pcie_replay", i)),
    147: lambda fake, i: (_UINT, sum(fake._link_up(i, k) for k in range(fake.model.nvlinks))),
    185: lambda fake, i: (_UINT, fake._value(i, "power_watts") * 1000),
    186: lambda fake, i: (_UINT, fake._value(i, "power_watts") * 1000),
    197: lambda fake, i: (_ULL, fake._pcie_bytes[i][0]),
    198: lambda fake, i: (_ULL, fake._pcie_bytes[i][1]),
    230: lambda fake, i: (_UINT, fake._value(i, "recovery_action")),
}


class HealthSymbols:
    """Mixed into FakeNvmlLibrary, whose state (scenario, clock, faults) these symbols read."""

    def nvmlDeviceGetEccMode(self, handle: Any, current: Any, pending: Any) -> int:
        _, code = self._device(handle, "nvmlDeviceGetEccMode")
        if code == OK:
            _out(current).value, _out(pending).value = 1, 1
        return code

    def nvmlDeviceGetTotalEccErrors(self, handle: Any, error_type: Any, counter: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetTotalEccErrors")
        if code == OK:
            kind = "corrected" if _val(error_type) == pynvml.NVML_MEMORY_ERROR_TYPE_CORRECTED else "uncorrected"
            _out(ref).value = self._events("ecc", index, type=kind)
        return code

    def nvmlDeviceGetRemappedRows(self, handle: Any, corr: Any, unc: Any, pending: Any, failed: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetRemappedRows")
        if code == OK:
            _out(corr).value = self._events("remapped_rows", index, cause="correctable")
            _out(unc).value = self._events("remapped_rows", index, cause="uncorrectable")
            _out(pending).value = 1 if self._active("remap_pending", index) else 0
            _out(failed).value = 1 if self._active("remap_failed", index) else 0
        return code

    def nvmlDeviceGetRetiredPages(self, handle: Any, cause: Any, count: Any, pages: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetRetiredPages")
        if code != OK:
            return code
        label = (
            "single_bit"
            if _val(cause) == pynvml.NVML_PAGE_RETIREMENT_CAUSE_MULTIPLE_SINGLE_BIT_ECC_ERRORS
            else "double_bit"
        )
        n = self._events("retired_pages", index, cause=label)
        if pages is not None:
            for slot in range(min(n, _out(count).value)):
                pages[slot] = 0x1000 * (slot + 1)
        _out(count).value = n
        return OK

    def nvmlDeviceGetRetiredPagesPendingStatus(self, handle: Any, ref: Any) -> int:
        return self._uint(
            handle,
            ref,
            "nvmlDeviceGetRetiredPagesPendingStatus",
            lambda i: 1 if self._active("retired_pages_pending", i) else 0,
        )

    def _link_up(self, index: int, link: int) -> bool:
        return not any(f.link == link for f in self._active("nvlink_down", index))

    def _field(self, index: int, field_id: int, scope: int) -> tuple[int, int, float]:
        """(return code, value type, value) of one field for one GPU."""
        links = self.model.nvlinks
        if field_id in self.model.unsupported_fields or any(
            f.field == field_id for f in self._active("not_supported", index)
        ):
            return pynvml.NVML_ERROR_NOT_SUPPORTED, _UINT, 0
        simple = _SIMPLE_FIELDS.get(field_id)
        if simple is not None:
            value_type, value = simple(self, index)
            return OK, value_type, value
        if field_id in _THROTTLE_FIELD_BITS:
            return OK, _ULL, self._throttle_ns[index][field_id]
        if field_id == 147 and self.scenario.node.nvlink != "nvswitch":
            return pynvml.NVML_ERROR_NOT_SUPPORTED, _UINT, 0
        scoped = {165: None, 161: "replay", 162: "recovery", 163: "crc_flit"}
        if field_id in scoped:
            if scope >= links:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT, _UINT, 0
            if field_id == 165:
                return OK, _UINT, 1 if self._link_up(index, scope) else 0
            return OK, _ULL, self._events("nvlink_errors", index, link=scope, type=scoped[field_id])
        for table, kind in ((_NVLINK_CRC_DATA, "crc_data"), (_NVLINK_ECC, "ecc")):
            if field_id in table:
                link = table.index(field_id)
                if link >= links:
                    return pynvml.NVML_ERROR_NOT_SUPPORTED, _UINT, 0
                return OK, _ULL, self._events("nvlink_errors", index, link=link, type=kind)
        return pynvml.NVML_ERROR_NOT_SUPPORTED, _UINT, 0

    def nvmlDeviceGetFieldValues(self, handle: Any, count: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetFieldValues")
        if code != OK:
            return code
        self._integrate()
        entries = _out(ref)
        stamp = int(time.time() * 1e6)
        for slot in range(_val(count)):
            entry = entries[slot]
            ret, value_type, value = self._field(index, entry.fieldId, entry.scopeId)
            entry.nvmlReturn, entry.valueType, entry.timestamp, entry.latencyUsec = ret, value_type, stamp, 0
            if ret == OK:
                if value_type == _ULL:
                    entry.value.ullVal = int(value)
                else:
                    entry.value.uiVal = int(round(value))
        return OK

    def nvmlDeviceGetNvLinkRemotePciInfo_v2(self, handle: Any, link: Any, ref: Any) -> int:
        _, code = self._device(handle, "nvmlDeviceGetNvLinkRemotePciInfo_v2")
        if code == OK:
            if _val(link) >= self.model.nvlinks:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            _out(ref).busId = _NVSWITCH_BUS
        return code

    def nvmlDeviceGetNvLinkState(self, handle: Any, link: Any, ref: Any) -> int:
        index, code = self._device(handle, "nvmlDeviceGetNvLinkState")
        if code == OK:
            if _val(link) >= self.model.nvlinks:
                return pynvml.NVML_ERROR_INVALID_ARGUMENT
            _out(ref).value = 1 if self._link_up(index, _val(link)) else 0
        return code

    def _numa(self, index: int) -> int:
        return index * self.scenario.node.numa_nodes // self.count

    def nvmlDeviceGetTopologyCommonAncestor(self, first: Any, second: Any, ref: Any) -> int:
        a, code = self._device(first, "nvmlDeviceGetTopologyCommonAncestor")
        b, code_b = self._device(second, "nvmlDeviceGetTopologyCommonAncestor")
        if code != OK or code_b != OK:
            return code if code != OK else code_b
        same = self._numa(a) == self._numa(b)
        _out(ref).value = _LEVELS[self.scenario.node.pcie_same_numa if same else "SYS"]
        return OK

    def nvmlDeviceGetP2PStatus(self, first: Any, second: Any, index: Any, ref: Any) -> int:
        a, code = self._device(first, "nvmlDeviceGetP2PStatus")
        b, code_b = self._device(second, "nvmlDeviceGetP2PStatus")
        if code != OK or code_b != OK:
            return code if code != OK else code_b
        nvlink = self.scenario.node.nvlink == "nvswitch" and self.model.nvlinks > 0
        if _val(index) == pynvml.NVML_P2P_CAPS_INDEX_NVLINK:
            _out(ref).value = pynvml.NVML_P2P_STATUS_OK if nvlink else pynvml.NVML_P2P_STATUS_NOT_SUPPORTED
        else:
            _out(ref).value = pynvml.NVML_P2P_STATUS_OK
        return OK
