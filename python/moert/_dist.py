# SPDX-License-Identifier: Apache-2.0
"""moert communicators from torch.distributed: NCCL (a unique id broadcast through the process group) on GPUs,
and on CPUs moert's collectives through the process group (gloo) via a moert_collectives table of ctypes
callbacks."""
import ctypes
import datetime
import threading
import weakref

import torch
import torch.distributed as dist

from . import _capi


# A process group of this rank alone, whatever torch.distributed says: moert.torch.Experts, whose layers never
# communicate (the experts of one rank on rows already dispatched).
ALONE = "alone"


def group_rank_world(process_group):
    """(rank, world_size) in the expert-parallel group: process_group, else the default group, else (0, 1)."""
    if process_group is ALONE:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("moert: process_group given but torch.distributed is not initialized")
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def global_rank(process_group, group_rank):
    if process_group is None:
        return group_rank
    if hasattr(dist, "get_global_rank"):
        return dist.get_global_rank(process_group, group_rank)
    return dist.distributed_c10d._get_global_rank(process_group, group_rank)  # torch < 2.0


def backend_name(process_group):
    return str(dist.get_backend(process_group)).lower()


def _host_bytes(ptr, nbytes):
    """A uint8 tensor over nbytes of host memory at ptr (zero-copy)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    buf = (ctypes.c_uint8 * nbytes).from_address(ptr)
    return torch.frombuffer(buf, dtype=torch.uint8)


_TORCH_OF_MOERT = {_capi.F32: torch.float32, _capi.F64: torch.float64, _capi.I64: torch.int64,
                   _capi.I32: torch.int32}


def _write_error(err, size, text):
    if not err or size == 0:
        return
    b = text.encode("utf-8", "replace")[: size - 1]
    ctypes.memmove(err, b + b"\0", len(b) + 1)


class GroupCollectives:
    """moert_collectives over a torch.distributed process group with CPU tensors (gloo). Host memory is wrapped
    without copies; every call waits at most timeout_s. allreduce_sum gathers and sums in rank order (in double
    for fp32), as moert's own communicator does, so every rank gets bit-identical sums."""

    def __init__(self, process_group, timeout_s):
        self.pg = process_group
        self.rank, self.world = group_rank_world(process_group)
        self.timeout = datetime.timedelta(seconds=float(timeout_s))
        self._a2a_single = True  # dist.all_to_all_single; falls back to isend/irecv pairs where unsupported
        table = _capi.Collectives()
        table.struct_size = ctypes.sizeof(_capi.Collectives)
        table.user = None
        # the callbacks must outlive the communicator: they are members of this object
        self._cb = [_capi.ALLGATHER_FN(self._guard("allgather", self._allgather)),
                    _capi.ALLREDUCE_FN(self._guard("allreduce_sum", self._allreduce)),
                    _capi.ALLTOALLV_FN(self._guard("alltoallv", self._alltoallv)),
                    _capi.BARRIER_FN(self._guard("barrier", self._barrier))]
        table.allgather, table.allreduce_sum, table.alltoallv, table.barrier = self._cb
        self.table = table
        self.last_exception = None

    def _guard(self, name, fn):
        def call(*args):
            err, size = args[-2], args[-1]
            try:
                fn(*args[1:-2])
                return 0
            except BaseException as e:  # noqa: B902 - nothing may unwind through C
                self.last_exception = e
                _write_error(err, size, "%s over torch.distributed (%s): %s: %s"
                             % (name, backend_name(self.pg), type(e).__name__, e))
                return 1
        return call

    def _wait(self, work):
        if work is not None:
            work.wait(self.timeout)

    def _gather(self, src):
        out = [torch.empty_like(src) for _ in range(self.world)]
        self._wait(dist.all_gather(out, src, group=self.pg, async_op=True))
        return out

    def _allgather(self, send, recv, nbytes):
        if nbytes == 0:
            return
        out = self._gather(_host_bytes(send, nbytes).clone())
        torch.cat(out, out=_host_bytes(recv, nbytes * self.world))

    def _allreduce(self, buf, count, dtype):
        if count == 0:
            return
        if dtype not in (_capi.F32, _capi.F64, _capi.I64):
            raise ValueError("dtype %s is not fp32, fp64 or int64" % _capi.DTYPE_NAMES[dtype])
        tdt = _TORCH_OF_MOERT[dtype]
        size = torch.empty(0, dtype=tdt).element_size()
        t = _host_bytes(buf, count * size).view(tdt)
        parts = self._gather(t.clone())
        acc = parts[0].double() if dtype == _capi.F32 else parts[0].clone()
        for p in parts[1:]:
            acc += p.double() if dtype == _capi.F32 else p
        t.copy_(acc)

    def _alltoallv(self, send, send_bytes, send_offsets, recv, recv_bytes, recv_offsets):
        w = self.world
        sb = [int(send_bytes[r]) for r in range(w)]
        so = [int(send_offsets[r]) for r in range(w)]
        rb = [int(recv_bytes[r]) for r in range(w)]
        ro = [int(recv_offsets[r]) for r in range(w)]
        send_t = _host_bytes(send, max([o + b for o, b in zip(so, sb)] + [0]))
        recv_t = _host_bytes(recv, max([o + b for o, b in zip(ro, rb)] + [0]))
        parts_in = [send_t[so[r]:so[r] + sb[r]] for r in range(w)]
        packed_in = torch.cat(parts_in) if sum(sb) else torch.empty(0, dtype=torch.uint8)
        packed_out = torch.empty(sum(rb), dtype=torch.uint8)
        if self._a2a_single:
            try:
                self._wait(dist.all_to_all_single(packed_out, packed_in, rb, sb, group=self.pg, async_op=True))
            except RuntimeError as e:
                if "not supported" not in str(e).lower() and "unsupported" not in str(e).lower():
                    raise
                self._a2a_single = False
        if not self._a2a_single:
            self._p2p(packed_in, sb, packed_out, rb)
        pos = 0
        for r in range(w):
            if rb[r]:
                recv_t[ro[r]:ro[r] + rb[r]].copy_(packed_out[pos:pos + rb[r]])
            pos += rb[r]

    def _p2p(self, packed_in, sb, packed_out, rb):
        """alltoallv as isend/irecv pairs (backends without all_to_all)."""
        ins, outs, pos = [], [], 0
        for n in sb:
            ins.append(packed_in[pos:pos + n])
            pos += n
        pos = 0
        for n in rb:
            outs.append(packed_out[pos:pos + n])
            pos += n
        works = []
        for r in range(self.world):
            if r == self.rank:
                outs[r].copy_(ins[r])
                continue
            g = global_rank(self.pg, r)
            if sb[r]:
                works.append(dist.isend(ins[r].contiguous(), dst=g, group=self.pg))
            if rb[r]:
                works.append(dist.irecv(outs[r], src=g, group=self.pg))
        for wk in works:
            self._wait(wk)

    def _barrier(self):
        t = torch.zeros(1)
        self._wait(dist.all_reduce(t, group=self.pg, async_op=True))


class Communicator:
    """One moert_comm of this rank for a process group and device; shared by the modules of that group (the
    layers keep a reference: the communicator is destroyed after the last of them)."""

    def __init__(self, process_group, device, timeout_s):
        self.rank, self.world = group_rank_world(process_group)
        self.ptr = ctypes.c_void_p()
        self.collectives = None
        self.users = 0
        lib = _capi.lib()
        if self.world == 1:
            return
        backend = backend_name(process_group)
        if device.type == "cuda":
            if backend != "nccl":
                raise ValueError("moert: on CUDA devices the process group must use the NCCL backend (got %s)"
                                 % backend)
            uid = (ctypes.c_uint8 * _capi.NCCL_ID_BYTES)()
            if self.rank == 0:
                _capi.check(lib.moert_nccl_unique_id(uid), "moert_nccl_unique_id")
            t = torch.tensor(bytearray(uid), dtype=torch.uint8, device=device)
            dist.broadcast(t, src=global_rank(process_group, 0), group=process_group)
            uid = (ctypes.c_uint8 * _capi.NCCL_ID_BYTES)(*t.cpu().tolist())
            _capi.check(lib.moert_comm_create_nccl(uid, self.world, float(timeout_s), ctypes.byref(self.ptr)),
                        "moert_comm_create_nccl")
        else:
            self.collectives = GroupCollectives(process_group, timeout_s)
            _capi.check(lib.moert_comm_create_collectives(self.world, ctypes.byref(self.collectives.table),
                                                          ctypes.byref(self.ptr)),
                        "moert_comm_create_collectives")

    def release(self):
        """One user (a moert_layers) less: destroyed after the last (moert requires it after every layers)."""
        self.users -= 1
        if self.users <= 0 and self.ptr and _capi._lib is not None:
            _capi._lib.moert_comm_destroy(self.ptr)
            self.ptr = ctypes.c_void_p()

    def __del__(self):
        if self.users <= 0:
            self.users = 1
            self.release()


_comms = weakref.WeakValueDictionary()
_comms_lock = threading.Lock()


def communicator(process_group, device, timeout_s):
    """The Communicator of (process_group, device), shared by every module of that group: on GPUs its layers share
    one NCCL communicator per rank (moert makes it with the first of them and frees it with the last)."""
    key = (id(process_group) if process_group is not None else None, str(device))
    with _comms_lock:
        c = _comms.get(key)
        if c is None:
            c = Communicator(process_group, device, timeout_s)
            _comms[key] = c
        return c
