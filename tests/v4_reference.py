"""From-scratch reference for the V4 decode step, used only by the tests.

It shares no code with `model/`: it reads the weights by their official names and recomputes,
for one sequence, the logits at every position from the full token history, with no cache
(compressed entries are pooled again from the raw tokens, the window is re-sliced, the
indexer re-scores every visible entry). Written for clarity, not speed."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0), from frexp: x = m * 2**e with m in [0.5, 1)."""
    m, e = torch.frexp(x)
    return torch.where(m == 0.5, torch.ldexp(torch.ones_like(x), e - 1), torch.ldexp(torch.ones_like(x), e))


def fp8_round_trip(x: torch.Tensor, block: int, pow2: bool) -> torch.Tensor:
    xb = x.float().reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=1e-4)
    s = pow2_at_least(amax / 448.0) if pow2 else amax / 448.0
    q = (xb / s).clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return (q * s).reshape(x.shape).to(x.dtype)


def nearest_e2m1(y: torch.Tensor) -> torch.Tensor:
    """Brute force: nearest grid magnitude, ties to the even code (0, 1, 2, 4)."""
    grid = E2M1_GRID.to(y.device)
    dist = (y.abs().unsqueeze(-1) - grid).abs()
    best = dist == dist.amin(-1, keepdim=True)
    even = best & (torch.arange(8, device=y.device) % 2 == 0)
    idx = torch.where(even.any(-1), even.float().argmax(-1), best.float().argmax(-1))
    return torch.sign(y) * grid[idx]


def fp4_round_trip(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    xb = x.float().reshape(*x.shape[:-1], -1, block)
    amax = xb.abs().amax(-1, keepdim=True).clamp(min=6 * 2.0**-126)
    s = pow2_at_least(amax / 6.0)
    q = nearest_e2m1((xb / s).clamp(-6, 6))
    return (q * s).reshape(x.shape).to(x.dtype)


def dequantize(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A block-scaled checkpoint weight as fp32: e4m3 [out, in] with one scale per 128 x 128
    block, or e2m1 codes packed two per byte (low nibble first) with one scale per 32 inputs."""
    s = scale.float()
    if weight.dtype == torch.float8_e4m3fn:
        out, inp = weight.shape
        blocks = s[torch.arange(out)[:, None] // 128, torch.arange(inp)[None, :] // 128]
        return weight.float() * blocks
    codes = weight.view(torch.uint8).long()
    codes = torch.stack([codes % 16, codes // 16], -1).flatten(-2)
    values = E2M1_GRID[codes % 8] * torch.where(codes >= 8, -1.0, 1.0)
    return values * s[:, torch.arange(values.shape[-1]) // 32]


def hadamard(n: int) -> torch.Tensor:
    i = torch.arange(n)
    parity = torch.tensor([bin(v).count("1") % 2 for v in range(n)])[(i[:, None] & i[None, :])]
    return (1 - 2 * parity).float() / math.sqrt(n)


class V4Reference:
    def __init__(self, cfg, weights: dict[str, torch.Tensor], dtype: torch.dtype):
        self.cfg = cfg
        self.w = {k: v.detach().cpu() for k, v in weights.items()}
        self.dtype = dtype
        self.had = hadamard(cfg.index_head_dim)
        self.dequantized: dict[str, torch.Tensor] = {}

    # -- pieces -------------------------------------------------------------------------------
    def freqs(self, compressed: bool) -> torch.Tensor:
        c, d = self.cfg, self.cfg.rope_head_dim
        theta = c.compress_rope_theta if compressed else c.rope_theta
        f = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
        if compressed and c.original_seq_len > 0:
            def dim_for(rot):
                return d * math.log(c.original_seq_len / (rot * 2 * math.pi)) / (2 * math.log(theta))
            lo, hi = max(math.floor(dim_for(c.beta_fast)), 0), min(math.ceil(dim_for(c.beta_slow)), d - 1)
            hi = hi if hi != lo else hi + 0.001
            ramp = ((torch.arange(d // 2, dtype=torch.float32) - lo) / (hi - lo)).clamp(0, 1)
            f = f / c.rope_factor * ramp + f * (1 - ramp)
        return f

    def rope(self, x: torch.Tensor, pos: torch.Tensor, compressed: bool, inverse=False) -> torch.Tensor:
        """x [T, ..., C] rotated by position pos [T] on its last rope_head_dim channels."""
        rd = self.cfg.rope_head_dim
        ang = pos.float()[:, None] * self.freqs(compressed)[None, :]
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (rd // 2,)
        cos, sin = torch.cos(ang).reshape(shape), torch.sin(ang).reshape(shape)
        if inverse:
            sin = -sin
        a, b = x[..., -rd:].float()[..., 0::2], x[..., -rd:].float()[..., 1::2]
        rot = torch.stack([a * cos - b * sin, a * sin + b * cos], -1).flatten(-2)
        return torch.cat([x[..., :-rd], rot.to(x.dtype)], -1)

    def rms(self, x: torch.Tensor, weight_name: str) -> torch.Tensor:
        x32 = x.float()
        return (self.w[weight_name] * x32 / torch.sqrt(x32.pow(2).mean(-1, keepdim=True) + self.cfg.norm_eps)).to(x.dtype)

    def lin(self, x: torch.Tensor, name: str) -> torch.Tensor:
        """x W^T; for a block-scaled W the official linear(): x rounded to e4m3 per 128 values,
        the product of the dequantised operands in fp32, the result in x's dtype."""
        scale = self.w.get(name[: -len("weight")] + "scale")
        if scale is None:
            return x @ self.w[name].t()
        pow2 = self.cfg.scale_dtype == "fp8" or self.cfg.scale_fmt == "ue8m0"
        if name not in self.dequantized:
            self.dequantized[name] = dequantize(self.w[name], scale)
        return (fp8_round_trip(x.float(), 128, pow2) @ self.dequantized[name].t()).to(x.dtype)

    def hc_mix(self, h: torch.Tensor, prefix: str):
        """h [T, hc, D] -> (x [T, D], post [T, hc], comb [T, hc, hc])."""
        c, n = self.cfg, self.cfg.hc_mult
        flat = h.reshape(h.shape[0], -1).float()
        m = flat @ self.w[prefix + "_fn"].t() / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + c.norm_eps)
        s, b = self.w[prefix + "_scale"], self.w[prefix + "_base"]
        pre = torch.sigmoid(m[:, :n] * s[0] + b[:n]) + c.hc_eps
        post = 2 * torch.sigmoid(m[:, n : 2 * n] * s[1] + b[n : 2 * n])
        a = (m[:, 2 * n :] * s[2] + b[2 * n :]).reshape(-1, n, n)
        a = torch.exp(a - a.amax(-1, keepdim=True))
        a = a / a.sum(-1, keepdim=True) + c.hc_eps
        a = a / (a.sum(1, keepdim=True) + c.hc_eps)
        for _ in range(c.hc_sinkhorn_iters - 1):
            a = a / (a.sum(2, keepdim=True) + c.hc_eps)
            a = a / (a.sum(1, keepdim=True) + c.hc_eps)
        x = (pre[:, :, None] * flat.reshape(h.shape)).sum(1)
        return x.to(h.dtype), post, a

    def compressed_entries(self, xn: torch.Tensor, prefix: str, ratio: int, rotate: bool) -> torch.Tensor:
        """Every complete compressed entry of the sequence [T // ratio, head_dim], pooled from scratch."""
        c = self.cfg
        d = self.w[prefix + ".norm.weight"].shape[0]
        kv = self.lin(xn.float(), prefix + ".wkv.weight")
        sc = self.lin(xn.float(), prefix + ".wgate.weight") + self.w[prefix + ".ape"][torch.arange(xn.shape[0]) % ratio]
        out = []
        for i in range(xn.shape[0] // ratio):
            cur = slice(i * ratio, (i + 1) * ratio)
            if ratio == 4:
                rows_kv, rows_sc = [kv[cur, d:]], [sc[cur, d:]]
                if i > 0:
                    prev = slice((i - 1) * ratio, i * ratio)
                    rows_kv.insert(0, kv[prev, :d])
                    rows_sc.insert(0, sc[prev, :d])
                rows_kv, rows_sc = torch.cat(rows_kv), torch.cat(rows_sc)
            else:
                rows_kv, rows_sc = kv[cur], sc[cur]
            out.append((rows_kv * torch.softmax(rows_sc, 0)).sum(0))
        if not out:
            return torch.zeros(0, d, dtype=self.dtype)
        e = self.rms(torch.stack(out).to(self.dtype), prefix + ".norm.weight")
        e = self.rope(e, torch.arange(e.shape[0]) * ratio, compressed=True)
        if rotate:
            e = (e.float() @ self.had).to(self.dtype)
            return fp4_round_trip(e) if c.qat else e
        if c.qat:
            nope = d - c.rope_head_dim
            e = torch.cat([fp8_round_trip(e[:, :nope], 64, c.scale_fmt == "ue8m0"), e[:, nope:]], -1)
        return e

    def attention(self, xn: torch.Tensor, layer: int) -> torch.Tensor:
        c, p = self.cfg, f"layers.{layer}.attn"
        T, H, hd, rd = xn.shape[0], c.n_heads, c.head_dim, c.rope_head_dim
        ratio = c.compress_ratios[layer]
        pos = torch.arange(T)
        qr = self.rms(self.lin(xn, p + ".wq_a.weight"), p + ".q_norm.weight")
        q = self.lin(qr, p + ".wq_b.weight").reshape(T, H, hd)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + c.norm_eps)
        q = self.rope(q, pos, ratio > 0)
        kv = self.rope(self.rms(self.lin(xn, p + ".wkv.weight"), p + ".kv_norm.weight"), pos, ratio > 0)
        if c.qat:
            kv = torch.cat([fp8_round_trip(kv[:, : hd - rd], 64, c.scale_fmt == "ue8m0"), kv[:, hd - rd :]], -1)
        comp = self.compressed_entries(xn, p + ".compressor", ratio, False) if ratio else None
        if ratio == 4:
            ip = p + ".indexer"
            icomp = self.compressed_entries(xn, ip + ".compressor", 4, True)
            iq = self.lin(qr, ip + ".wq_b.weight").reshape(T, c.index_n_heads, c.index_head_dim)
            iq = (self.rope(iq, pos, True).float() @ self.had).to(self.dtype)
            iq = fp4_round_trip(iq) if c.qat else iq
            iw = self.lin(xn, ip + ".weights_proj.weight") * (c.index_head_dim**-0.5 * c.index_n_heads**-0.5)
        outs = []
        for t in range(T):
            rows = [kv[max(0, t - c.window_size + 1) : t + 1]]
            visible = (t + 1) // ratio if ratio else 0
            if ratio == 128:
                rows.append(comp[:visible])
            elif ratio == 4 and visible:
                score = (torch.relu(iq[t].float() @ icomp[:visible].float().t()) * iw[t].float()[:, None]).sum(0)
                rows.append(comp[score.topk(min(c.index_topk, visible)).indices])
            rows = torch.cat(rows).float()
            s = (q[t].float() @ rows.t()) * hd**-0.5  # [H, n]
            m = s.amax(-1, keepdim=True)
            e = torch.exp(s - m)
            denom = e.sum(-1, keepdim=True) + torch.exp(self.w[p + ".attn_sink"][:, None] - m)
            outs.append(((e.to(self.dtype).float() @ rows) / denom).to(self.dtype))
        o = self.rope(torch.stack(outs), pos, ratio > 0, inverse=True)  # [T, H, hd]
        g, r = c.o_groups, c.o_lora_rank
        wo_a = self.w[p + ".wo_a.weight"].reshape(g, r, -1)
        o = torch.stack([o.reshape(T, g, -1)[:, j] @ wo_a[j].t() for j in range(g)], 1)
        return self.lin(o.reshape(T, -1), p + ".wo_b.weight")

    def moe(self, xn: torch.Tensor, tokens: torch.Tensor, layer: int) -> torch.Tensor:
        c, p = self.cfg, f"layers.{layer}.ffn"
        scores = torch.sqrt(F.softplus(xn.float() @ self.w[p + ".gate.weight"].float().t()))
        if layer < c.n_hash_layers:
            ids = self.w[p + ".gate.tid2eid"][tokens].long()
        else:
            ids = (scores + self.w[p + ".gate.bias"]).topk(c.n_activated_experts, -1).indices
        wts = scores.gather(1, ids)
        wts = wts / wts.sum(-1, keepdim=True) * c.route_scale
        lim = c.swiglu_limit

        def expert(x, prefix, weight=None):
            g = self.lin(x, prefix + ".w1.weight").float().clamp(max=lim)
            u = self.lin(x, prefix + ".w3.weight").float().clamp(-lim, lim)
            h = g * torch.sigmoid(g) * u
            if weight is not None:
                h = h * weight
            return self.lin(h.to(self.dtype), prefix + ".w2.weight")

        out = torch.zeros(xn.shape, dtype=torch.float32)
        for t in range(xn.shape[0]):
            for j in range(ids.shape[1]):
                out[t] += expert(xn[t : t + 1], f"{p}.experts.{int(ids[t, j])}", wts[t, j])[0].float()
        out += expert(xn, p + ".shared_experts").float()
        return out.to(self.dtype)

    # -- whole sequence -----------------------------------------------------------------------
    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """[T, vocab] fp32 logits at every position of the sequence `tokens` [T]."""
        c = self.cfg
        h = self.w["embed.weight"][tokens].unsqueeze(1).repeat(1, c.hc_mult, 1)
        for layer in range(c.n_layers):
            for side in ("attn", "ffn"):
                x, post, comb = self.hc_mix(h, f"layers.{layer}.hc_{side}")
                xn = self.rms(x, f"layers.{layer}.{side}_norm.weight")
                out = self.attention(xn, layer) if side == "attn" else self.moe(xn, tokens, layer)
                h = (post[:, :, None] * out.float()[:, None, :] + (comb[:, :, :, None] * h.float()[:, :, None, :]).sum(1))
                h = h.to(self.dtype)
        flat = h.reshape(h.shape[0], -1).float()
        m = flat @ self.w["hc_head_fn"].t() / torch.sqrt(flat.pow(2).mean(-1, keepdim=True) + c.norm_eps)
        pre = torch.sigmoid(m * self.w["hc_head_scale"] + self.w["hc_head_base"]) + c.hc_eps
        x = (pre[:, :, None] * flat.reshape(h.shape)).sum(1).to(self.dtype)
        return self.rms(x, "norm.weight").float() @ self.w["head.weight"].t()
