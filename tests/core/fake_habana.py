"""A test double of the Gaudi software's `habana_frameworks` package.

It enforces FusedSDPA's contract (see shared notes: argument order and types per Gaudi software version,
valid_seq_len only with is_causal and no mask, int32 lengths, k/v with their own head count), records every call,
and computes the reference math on the CPU so that generation through it can be compared with the default path.
Its `wrap_in_hpu_graph` holds the HPU path to Gaudi's graph contract: a host read while a graph is recorded or
replayed fails the call (`optimum.habana.utils.graph_capture.HostReads`), and graphs are keyed by input signature as
Habana's own cache keys them (tensors by shape, other values by hash). `CacheAccesses` sees what touches a KV cache's
storage outside the kernel: a decode step on Gaudi must write it in place and leave the reading to FusedSDPA.
"""

import contextlib
import math
import sys
import types
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.cache_utils import Cache

from optimum.habana.utils.graph_capture import HostReads


# Positional parameters after (q, k, v) per Gaudi software version; each version extends the one before.
SIGNATURE_1_13 = ("attn_mask", "dropout_p", "is_causal", "scale")
SIGNATURE_1_16 = (*SIGNATURE_1_13, "softmax_mode")
SIGNATURE_1_18 = (*SIGNATURE_1_16, "recompute_mode", "valid_seq_len", "seq_padding_type")
SIGNATURES = {
    "1.18": SIGNATURE_1_18,
    # Later 1.18-style kernels: four trailing extras; the recompute variant reads the window and the sinks.
    "1.18-sinks": (*SIGNATURE_1_18, "return_dropout_mask", "return_attn_probs", "window_size", "sink"),
    "1.16": SIGNATURE_1_16,
    "1.13": SIGNATURE_1_13,
}


@dataclass
class KernelCall:
    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    arguments: dict
    positional_count: int
    recompute_context: bool | None  # the sdp_kernel(enable_recompute=...) in force, if any


@dataclass
class FakeHabana:
    version: str
    calls: list[KernelCall] = field(default_factory=list)
    recompute_context: list[bool] = field(default_factory=list)
    graphs: dict = field(default_factory=dict)  # input hash -> replays, of every wrap_in_hpu_graph
    in_kernel: bool = False  # while FusedSDPA.apply runs


class CacheAccesses(TorchDispatchMode):
    """Counts, by operator, what touches the given storages (a KV cache's) outside the kernel; views, which only
    describe the storage, do not count. The kernel's own reads are its calls (`FakeHabana.calls`)."""

    def __init__(self, state: FakeHabana, storages: set[int]) -> None:
        super().__init__()
        self.state, self.storages = state, storages
        self.counts: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.state.in_kernel and not func.is_view:
            tensors = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
            if any(tensor.untyped_storage().data_ptr() in self.storages for tensor in tensors):
                name = func.overloadpacket._qualified_op_name
                self.counts[name] = self.counts.get(name, 0) + 1
        return func(*args, **(kwargs or {}))


def input_hash(value) -> int:
    """How HPU graphs key their cache: tensors by shape, other values by their own hash."""
    if isinstance(value, dict):
        return input_hash(tuple(value.items()))
    if isinstance(value, (list, tuple)):
        return hash(tuple(input_hash(item) for item in value))
    if isinstance(value, torch.Tensor):
        return hash((tuple(value.shape), value.dtype))
    return hash(value)


def host_numbers(value) -> list[tuple[object, dict]]:
    """The Python numbers (ints, floats, bools, None) of the KV caches among a forward's inputs, and of their layers:
    a replayed HPU graph runs no Python, so it neither reads nor changes them."""
    if isinstance(value, dict):
        return [found for item in value.values() for found in host_numbers(item)]
    if isinstance(value, (list, tuple)):
        return [found for item in value for found in host_numbers(item)]
    if not isinstance(value, Cache):
        return []
    return [
        (
            holder,
            {name: number for name, number in vars(holder).items() if isinstance(number, (int, float, type(None)))},
        )
        for holder in (value, *getattr(value, "layers", ()))
    ]


def set_host_numbers(numbers: list[tuple[object, dict]]) -> None:
    for holder, values in numbers:
        for name, number in values.items():
            setattr(holder, name, number)


def reference_sdpa(query, key, value, attn_mask, is_causal, scale, valid_seq_len, seq_padding_type, sink=None):
    """Plain attention in fp32, with the kernel's own conventions; `sink` (one logit per head) joins each row's
    softmax and is dropped."""
    batch, heads, q_len, head_dim = query.shape
    kv_len = key.shape[2]
    groups = heads // key.shape[1]
    key = key.repeat_interleave(groups, dim=1).float()
    value = value.repeat_interleave(groups, dim=1).float()
    scale = 1.0 / math.sqrt(head_dim) if scale is None else scale
    scores = torch.matmul(query.float(), key.transpose(-1, -2)) * scale
    allowed = torch.ones(batch, 1, q_len, kv_len, dtype=torch.bool)
    if is_causal:
        allowed &= torch.ones(q_len, kv_len, dtype=torch.bool).tril()
    if valid_seq_len is not None:
        positions = torch.arange(kv_len)
        lengths = valid_seq_len.long()[:, None]
        if seq_padding_type == "left":
            real_keys = positions >= kv_len - lengths
        else:
            real_keys = positions < lengths
        allowed &= real_keys[:, None, None, :]
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    if attn_mask is not None:
        scores = scores + attn_mask.float()
    if sink is not None:
        column = sink.float().view(1, heads, 1, 1).expand(batch, heads, q_len, 1)
        probabilities = torch.cat([scores, column], dim=-1).softmax(dim=-1)[..., :-1]
    else:
        probabilities = scores.softmax(dim=-1)
    return torch.matmul(probabilities, value).to(query.dtype)


def treat_tensors_as_hpu(monkeypatch) -> None:
    """Make every module of the library that asks `on_hpu` see HPU tensors, as on a Gaudi card: each module that
    imported the function holds its own binding, and one left on the CPU answer plans for another device."""
    from optimum.habana import hpu

    original = hpu.on_hpu
    for name, module in list(sys.modules.items()):
        if name.startswith("optimum.habana") and getattr(module, "on_hpu", None) is original:
            monkeypatch.setattr(module, "on_hpu", lambda tensor: True)


def install(monkeypatch, version: str = "1.18") -> FakeHabana:
    """Put the double in sys.modules; returns the recorder."""
    state = FakeHabana(version)
    names = SIGNATURES[version]

    def check_contract(query, key, value, arguments):
        assert query.dim() == key.dim() == value.dim() == 4
        assert query.shape[1] % key.shape[1] == 0, "kv heads must divide query heads"
        assert query.shape[-1] == key.shape[-1] == value.shape[-1], "one head size: the caller pads latent values"
        mask = arguments["attn_mask"]
        assert mask is None or mask.is_floating_point(), "FusedSDPA takes an additive float mask"
        assert isinstance(arguments["dropout_p"], float)
        assert isinstance(arguments["is_causal"], bool)
        assert arguments["scale"] is None or isinstance(arguments["scale"], float)
        if "softmax_mode" in arguments:
            assert arguments["softmax_mode"] in ("None", "fast")
        if "recompute_mode" in arguments:
            assert isinstance(arguments["recompute_mode"], bool), "None would fall back to the global flag"
        if arguments.get("valid_seq_len") is not None:
            assert arguments["valid_seq_len"].dtype == torch.int32
            assert arguments["valid_seq_len"].shape == (query.shape[0],)
            assert arguments["is_causal"] and mask is None, "valid_seq_len is accepted only with is_causal, no mask"
        if "seq_padding_type" in arguments:
            assert arguments["seq_padding_type"] in ("left", "right")
        # The kernel trains when any of q, k, v needs a gradient (LoRA on v_proj alone trains through the value).
        backward = torch.is_grad_enabled() and (query.requires_grad or key.requires_grad or value.requires_grad)
        if arguments.get("softmax_mode") == "fast" and arguments.get("recompute_mode") and backward:
            assert arguments["is_causal"], "fast softmax in recompute training needs is_causal (the kernel raises)"
        if arguments.get("sink") is not None:
            assert arguments["recompute_mode"] is True, "only the recompute variant reads the sinks"
            assert arguments["sink"].shape == (query.shape[1],), "one sink logit per query head"
            grad = backward or (torch.is_grad_enabled() and arguments["sink"].requires_grad)
            assert not grad, "its backward returns no gradient for the sinks: inference only"
            assert arguments["return_dropout_mask"] is False and arguments["return_attn_probs"] is False
            assert arguments["window_size"] == (-1, -1)

    class FusedSDPA:
        @staticmethod
        def forward(ctx, q, k, v, *args):  # the real one is an autograd.Function; only the names matter here
            raise NotImplementedError

        @staticmethod
        def apply(query, key, value, *positional):
            # The trailing extras have defaults: a 1.18-style call may stop after seq_padding_type.
            allowed = {len(names), len(SIGNATURES["1.18"])} if version == "1.18-sinks" else {len(names)}
            assert len(positional) in allowed, f"Gaudi {version} takes {len(names)} arguments after q, k, v"
            arguments = dict(zip(names, positional, strict=False))
            check_contract(query, key, value, arguments)
            context = state.recompute_context[-1] if state.recompute_context else None
            state.calls.append(KernelCall(query, key, value, arguments, len(positional), context))
            state.in_kernel = True
            try:
                return reference_sdpa(
                    query,
                    key,
                    value,
                    arguments["attn_mask"],
                    arguments["is_causal"],
                    arguments["scale"],
                    arguments.get("valid_seq_len"),
                    arguments.get("seq_padding_type", "left"),
                    arguments.get("sink"),
                )
            finally:
                state.in_kernel = False

    # Give forward the version's real parameter names, which is what the library inspects.
    parameters = ", ".join(["ctx", "q", "k", "v", *names])
    namespace: dict = {}
    exec(f"def forward({parameters}):\n    raise NotImplementedError", namespace)
    FusedSDPA.forward = staticmethod(namespace["forward"])

    @contextlib.contextmanager
    def sdp_kernel(enable_recompute: bool = False):
        state.recompute_context.append(enable_recompute)
        try:
            yield
        finally:
            state.recompute_context.pop()

    def wrap_in_hpu_graph(module, max_graphs=None, **options):
        """Record a graph per input signature and replay it. A recorded graph holds the launches only: a host read
        while recording (or replaying: nothing runs Python then) fails the call, as it breaks the real contract.
        A replay runs the forward with the caches' Python numbers as they were when the graph was recorded (the
        branches and sizes the recording took), and leaves them as they were before the call."""
        eager_forward = module.forward
        recorded: dict[int, list] = {}

        def forward(*args, **kwargs):
            key = input_hash((args, kwargs))
            state.graphs[key] = state.graphs.get(key, -1) + 1
            before = host_numbers((args, kwargs))
            replay = key in recorded
            if replay:
                set_host_numbers(recorded[key])
            else:
                recorded[key] = before
            try:
                with HostReads(forbid=True, what="an HPU graph (wrap_in_hpu_graph)"):
                    return eager_forward(*args, **kwargs)
            finally:
                if replay:
                    set_host_numbers(before)

        module.forward = forward
        return module

    root = types.ModuleType("habana_frameworks")
    torch_module = types.ModuleType("habana_frameworks.torch")
    hpex = types.ModuleType("habana_frameworks.torch.hpex")
    kernels = types.ModuleType("habana_frameworks.torch.hpex.kernels")
    hpu = types.ModuleType("habana_frameworks.torch.hpu")
    kernels.FusedSDPA = FusedSDPA
    hpu.sdp_kernel = sdp_kernel
    hpu.wrap_in_hpu_graph = wrap_in_hpu_graph
    hpu.is_available = lambda: True
    root.torch, torch_module.hpex, torch_module.hpu, hpex.kernels = torch_module, hpex, hpu, kernels
    for module in (root, torch_module, hpex, kernels, hpu):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    return state
