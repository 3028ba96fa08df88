"""Latent attention's decode step over the compressed cache itself (weight absorption), on every device.

DeepSeek V2/V3 and the families made from them (Kimi, GLM-4 MoE Lite, LongCat, ...) cache, per token and layer,
one latent `c` (`kv_lora_rank` numbers) and one rotary key part `r` shared by all heads. Their own code expands
the whole cache into every head's keys and values before each attention call (`kv_b_proj` over the context:
`k_h = W_k,h c`, `v_h = W_v,h c`), which costs far more than the attention does. Since both are linear in `c`:

    q_h · k_h(t) = (W_k,hᵀ q_nope,h) · c(t) + q_rot,h · r(t)
    Σ_t p_h(t) v_h(t) = W_v,h Σ_t p_h(t) c(t)

so a step absorbs `W_k` into its query and `W_v` into its output and attends over the latents as they lie in the
cache: one key/value head shared by every query head, whose rows are stacked into one matrix product per
sequence. Scores and weights are the expanded attention's; only the order of the sums differs. Each query row
costs `2 * kv_lora_rank + rope` products per key (against `qk + v` after expansion), which is why it pays for a
few rows (decode steps), not for a prompt.
"""

import torch
from torch.nn import functional as F

from .dispatch import fully_masked_queries, weights_for_value_product
from .sinks import sink_logits


def absorbed_latent_sdpa(
    query: torch.Tensor,
    latent: torch.Tensor,
    rotary_key: torch.Tensor,
    up_projection: torch.Tensor,
    attn_mask: torch.Tensor | None,
    *,
    scale: float,
    dropout_p: float = 0.0,
    sinks: torch.Tensor | None = None,
    floor_attends: bool = False,
) -> torch.Tensor:
    """Attention of query `[B, H, q, nope + rope]` over the compressed cache: latent `[B, 1, kv, L]`, rotary key
    `[B, 1, kv, rope]`; `up_projection` is `kv_b_proj.weight`, `[H * (nope + v), L]`. Returns `[B, H, q, v]`.

    `attn_mask`: boolean (True = attend) or additive, broadcastable to `[B, H, q, kv]`. A query that may attend to
    no key gets a zero output, or with `floor_attends` the values' average from a float mask's finite lowest scores
    (`dispatch.fully_masked_queries`). `sinks` (one logit per head, `[H]`, or per head and
    row) join each row's softmax, without a column added to the scores."""
    batch, heads, q_len, _ = query.shape
    kv_len, latent_size, rope = latent.shape[2], latent.shape[3], rotary_key.shape[3]
    nope = query.shape[3] - rope
    per_head = up_projection.view(heads, -1, latent_size)  # [H, nope + v, L]
    query_nope, query_rot = query.split([nope, rope], dim=-1)
    # Each head's rows through its own up-projection, heads as the batch of one product (the weights read once).
    head_rows = query_nope.permute(1, 0, 2, 3).reshape(heads, batch * q_len, nope)
    query_latent = through_key_up(head_rows, per_head, nope).view(heads, batch, q_len, latent_size).transpose(0, 1)
    query_latent = query_latent.reshape(batch, heads * q_len, latent_size)
    # Every head's rows against the one latent head: [B, H * q, L] @ [B, L, kv], the rotary part added.
    query_rot = query_rot.reshape(batch, heads * q_len, rope)
    scores = cache_scores(query_latent, query_rot, latent[:, 0], rotary_key[:, 0], scale)
    scores = scores.view(batch, heads, q_len, kv_len)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        scores = scores.masked_fill(~attn_mask, torch.finfo(scores.dtype).min)
    elif attn_mask is not None:
        scores = scores + attn_mask
    if sinks is None:
        weights = F.softmax(scores, dim=-1, dtype=torch.float32)
    else:
        sink = sink_logits(sinks, batch, heads, q_len).float().unsqueeze(-1)  # [B or 1, H, q or 1, 1]
        scores = scores.float()
        peak = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
        exponentials = torch.exp(scores - peak)
        weights = exponentials / (exponentials.sum(dim=-1, keepdim=True) + torch.exp(sink - peak))
    weights = weights.to(query.dtype)
    masked_rows = fully_masked_queries(attn_mask, floor_attends)
    if masked_rows is not None:
        weights = weights.masked_fill(masked_rows, 0.0)
    weights = F.dropout(weights, p=dropout_p, training=dropout_p > 0.0)
    weights = weights_for_value_product(weights.view(batch, heads * q_len, kv_len))
    output_latent = weighted_latents(weights, latent[:, 0])  # [B, H * q, L]
    output_rows = output_latent.view(batch, heads, q_len, latent_size).transpose(0, 1).reshape(heads, -1, latent_size)
    output = through_value_up(output_rows, per_head, nope)  # [H, B * q, v]
    return output.view(heads, batch, q_len, -1).transpose(0, 1)


def copies_batched_operands(tensor: torch.Tensor) -> bool:
    """Whether PyTorch's batched products copy an operand whose matrices do not lie back to back, or lie transposed,
    before multiplying: on CPU in half precision (oneDNN) they do; in float32 on CPU, and on CUDA, a batch's strides
    cost no copy. Measured on an Intel Xeon with AMX, 2 threads, in bfloat16: DeepSeek-V3's up-projection (each
    head's key rows lie between its value rows) took most of a layer's absorbed step, 9.3 -> 5.1 ms at 2048 tokens
    and 17.1 -> 9.0 ms at 8192 without the copies; and a batch of 4 sequences in a `GrowingCache` (its storage
    longer than the tokens) copied its whole latent cache twice a step, and its rotary keys once (10.0 -> 2.8 ms
    for the scores at 2048 tokens, 2.5 -> 1.7 ms for the weighted sum)."""
    return tensor.device.type == "cpu" and tensor.dtype in (torch.bfloat16, torch.float16)


def cache_scores(
    query_latent: torch.Tensor, query_rot: torch.Tensor, latent: torch.Tensor, rotary_key: torch.Tensor, scale: float
) -> torch.Tensor:
    """`scale` x the rows `[B, M, L]` and `[B, M, rope]` against the cached latents `[B, kv, L]` and rotary keys
    `[B, kv, rope]`: `[B, M, kv]`. Where a batched product would copy the cache (`copies_batched_operands`), one
    product per sequence reads each as it lies (in eager code: compiled, one product keeps the batch size free, and
    the compiler lays its operands out itself)."""
    if copies_batched_operands(latent) and not torch.compiler.is_compiling():
        return torch.stack(
            [
                torch.addmm(rows_rot @ keys.T, rows, latents.T, beta=scale, alpha=scale)
                for rows, rows_rot, latents, keys in zip(query_latent, query_rot, latent, rotary_key, strict=True)
            ]
        )
    rotary_scores = torch.matmul(query_rot, rotary_key.transpose(1, 2))
    return torch.baddbmm(rotary_scores, query_latent, latent.transpose(1, 2), beta=scale, alpha=scale)


def weighted_latents(weights: torch.Tensor, latent: torch.Tensor) -> torch.Tensor:
    """The weights `[B, M, kv]` times the cached latents `[B, kv, L]`: `[B, M, L]`, one product per sequence where a
    batched one would copy the cache (`copies_batched_operands`), in eager code as `cache_scores`."""
    if copies_batched_operands(latent) and not torch.compiler.is_compiling():
        return torch.stack([rows @ latents for rows, latents in zip(weights, latent, strict=True)])
    return torch.bmm(weights, latent)


def through_key_up(head_rows: torch.Tensor, per_head: torch.Tensor, nope: int) -> torch.Tensor:
    """`[H, M, nope]` rows through each head's key up-projection: `[H, M, L]`. Where the key rows' slice would be
    copied (`copies_batched_operands`), the rows take zeros for the value part and meet each head's whole block instead:
    twice the bytes read, nothing copied, the same products (the zeros add exactly nothing)."""
    if copies_batched_operands(per_head):
        return torch.bmm(F.pad(head_rows, (0, per_head.shape[1] - nope)), per_head)
    return torch.bmm(head_rows, per_head[:, :nope])


def through_value_up(output_rows: torch.Tensor, per_head: torch.Tensor, nope: int) -> torch.Tensor:
    """`[H, M, L]` latent outputs through each head's value up-projection: `[H, M, v]`. Where the value rows' slice
    would be copied (`copies_batched_operands`), each head's whole block multiplies the outputs and the value rows of the
    product are kept: the key rows' products are computed and dropped, nothing copied."""
    if copies_batched_operands(per_head):
        return torch.bmm(per_head, output_rows.transpose(1, 2))[:, nope:].transpose(1, 2)
    return torch.bmm(output_rows, per_head[:, nope:].transpose(1, 2))


def absorbs(q_len: int, latent_size: int, rope: int, nope: int, value_size: int) -> bool:
    """Whether absorption does less work than expansion for `q_len` query rows per sequence: absorbed, each row
    costs `2 * L + rope` products per key; expanded, each key costs `L * (nope + v)` to expand (then `qk + v` per
    row). The scores it holds, `q` per head and key, then stay below what expansion holds (`qk + v` per head and
    key): DeepSeek-V3's geometry absorbs up to 170 rows."""
    absorbed = q_len * (2 * latent_size + rope)
    expanded = latent_size * (nope + value_size) + q_len * (nope + rope + value_size)
    return absorbed < expanded
