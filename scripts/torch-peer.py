#!/usr/bin/env python3
"""torch-peer.py -- a PyTorch peer for spark's GPU benchmarks.

The Spark-X2.5 forward pass of SPARK.md written in plain PyTorch (the framework the reference
code runs on): bf16 weights and activations, float32 RMSNorm, RoPE and softmax, exact-erf GEGLU,
the head-wise sigmoid gate, sliding and full layers, a preallocated KV cache. It measures, on the
same checkpoint and GPU as `spark-run bench --backend cuda`:

  pp<P>   one prefill of P random tokens (torch's scaled_dot_product_attention, causal /
          sliding-window mask), tokens per second
  tg<N>   N decode steps at batch B, eager, and replayed as a torch CUDA graph (a static-shape
          step over the whole cache with a mask, the way serving engines run decode)

Output: one JSON object per test (test, batch, mode, tok_s_median, tok_s_all). Medians of --reps.

  python3 scripts/torch-peer.py --model DIR [-p 2048] [-n 128] [--batch 1,16] [--reps 3] [--device cuda]
  python3 scripts/torch-peer.py --check-golden testdata/golden/m8   # f32 on CPU vs the golden

--check-golden runs the f32 golden checkpoint on the CPU and compares its prefill logits with
the reference's (it must agree within 1e-4, as spark's backends do): the peer computes the model
it claims to.
"""
import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file


def load_weights(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        files = sorted(set(json.load(open(idx))["weight_map"].values()))
    else:
        files = [f for f in sorted(os.listdir(d)) if f.endswith(".safetensors")]
    w = {}
    for f in files:
        w.update(load_file(os.path.join(d, f)))
    return w


class Spark:
    def __init__(self, d, device, dtype, ctx):
        cfg = json.load(open(os.path.join(d, "config.json")))
        self.cfg = cfg
        self.device, self.dtype, self.ctx = device, dtype, ctx
        self.H = cfg["num_attention_heads"]
        self.KVH = cfg["num_key_value_heads"]
        self.D = cfg["head_dim"]
        self.eps = cfg["rms_norm_eps"]
        self.win = cfg["sliding_window"]
        self.types = cfg["layer_types"]
        w = load_weights(d)
        to = lambda t: t.to(device=device, dtype=dtype).contiguous()
        self.emb = to(w["model.embedding.weight"])
        self.head = to(w["lm_head.weight"]) if "lm_head.weight" in w else self.emb
        self.norm = w["model.norm.weight"].to(device=device, dtype=torch.float32)
        self.layers = []
        for i in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{i}."
            self.layers.append(
                dict(
                    ln1=w[p + "input_layernorm.weight"].to(device=device, dtype=torch.float32),
                    qkv=to(w[p + "self_attn.q_k_v_proj.weight"]),
                    g=to(w[p + "self_attn.g_proj.weight"]),
                    o=to(w[p + "self_attn.out_proj.weight"]),
                    ln2=w[p + "post_attention_layernorm.weight"].to(device=device, dtype=torch.float32),
                    gate=to(w[p + "mlp.gate_proj.weight"]),
                    up=to(w[p + "mlp.up_proj.weight"]),
                    down=to(w[p + "mlp.down_proj.weight"]),
                )
            )
        del w
        rp = cfg.get("rope_parameters", {})
        self.rope = {}
        for t in ("sliding_attention", "full_attention"):
            r = rp.get(t, {})
            theta = r.get("rope_theta", 10000.0)
            rot = int(self.D * r.get("partial_rotary_factor", 1.0))
            inv = theta ** (-torch.arange(0, rot, 2, dtype=torch.float64) / rot)
            ang = torch.arange(ctx, dtype=torch.float64)[:, None] * inv[None, :]
            self.rope[t] = (rot, ang.cos().float().to(device), ang.sin().float().to(device))

    def rms(self, x, w):
        x = x.float()
        return (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * w).to(self.dtype)

    def rotate(self, x, pos, t):
        # x [B, heads, T, D]; pos [B, T]
        rot, cos, sin = self.rope[t]
        half = rot // 2
        c, s = cos[pos][:, None], sin[pos][:, None]
        xf = x.float()
        a, b = xf[..., :half], xf[..., half:rot]
        out = torch.cat([a * c - b * s, b * c + a * s, xf[..., rot:]], dim=-1)
        return out.to(self.dtype)

    def new_cache(self, batch):
        shape = (batch, self.KVH, self.ctx, self.D)
        return [
            (torch.zeros(shape, device=self.device, dtype=self.dtype), torch.zeros(shape, device=self.device, dtype=self.dtype))
            for _ in self.layers
        ]

    def forward(self, ids, pos, cache, mask_len=None):
        """ids [B, T], pos [B, T] (absolute positions; each row contiguous); returns logits
        [B, T, vocab] float32. Keys are the cache's first `mask_len` slots (default: up to the
        last position)."""
        B, T = ids.shape
        H, KVH, D = self.H, self.KVH, self.D
        h = self.emb[ids].float()
        L = mask_len if mask_len is not None else int(pos.max()) + 1
        kpos = torch.arange(L, device=self.device)
        qp = pos[:, :, None]
        causal = kpos[None, None, :] <= qp
        for li, l in enumerate(self.layers):
            t = self.types[li]
            x = self.rms(h, l["ln1"])
            qkv = x @ l["qkv"].T
            g = x @ l["g"].T
            q = qkv[..., : H * D].view(B, T, H, D).transpose(1, 2)
            k = qkv[..., H * D : (H + KVH) * D].view(B, T, KVH, D).transpose(1, 2)
            v = qkv[..., (H + KVH) * D :].view(B, T, KVH, D).transpose(1, 2)
            q, k = self.rotate(q, pos, t), self.rotate(k, pos, t)
            kc, vc = cache[li]
            idx = pos[:, None, :, None].expand(B, KVH, T, D)
            kc.scatter_(2, idx, k)
            vc.scatter_(2, idx, v)
            allowed = causal if t == "full_attention" else causal & (kpos[None, None, :] > qp - self.win)
            o = F.scaled_dot_product_attention(
                q, kc[:, :, :L], vc[:, :, :L], attn_mask=allowed[:, None], scale=1.0 / math.sqrt(D), enable_gqa=True
            )
            o = o * torch.sigmoid(g.float()).to(self.dtype).transpose(1, 2)[..., None]
            h = h + (o.transpose(1, 2).reshape(B, T, H * D) @ l["o"].T).float()
            x = self.rms(h, l["ln2"])
            gu = F.gelu((x @ l["gate"].T).float(), approximate="none").to(self.dtype) * (x @ l["up"].T)
            h = h + (gu @ l["down"].T).float()
        return (self.rms(h, self.norm) @ self.head.T).float()


def check_golden(d):
    from safetensors.torch import load_file as lf

    gold = lf(os.path.join(d, "golden.safetensors"))
    m = Spark(os.path.join(d, "ckpt_f32"), "cpu", torch.float32, 4096)
    worst = 0.0
    for p in ("p0", "p1", "p2"):
        ids = gold[f"{p}.input_ids"].long()[None]
        pos = torch.arange(ids.shape[1])[None]
        logits = m.forward(ids, pos, m.new_cache(1))[0]
        want = gold[f"{p}.prefill_logits"].float().reshape(logits.shape)
        d_ = (logits - want).abs().max().item()
        # Cached decode of the reference's greedy ids, with a fixed key length (as the CUDA-graph
        # step uses) past the positions written.
        cache = m.new_cache(1)
        steps = [m.forward(ids, pos, cache)[0, -1]]
        for i, t in enumerate(gold[f"{p}.greedy_ids"].long()[:-1]):
            p_ = torch.tensor([[ids.shape[1] + i]])
            steps.append(m.forward(t.view(1, 1), p_, cache, mask_len=m.ctx)[0, -1])
        want_s = gold[f"{p}.step_logits"].float().reshape(len(steps), -1)
        d_s = (torch.stack(steps) - want_s).abs().max().item()
        worst = max(worst, d_, d_s)
        print(f"{p}: max |torch peer - reference f32|: prefill {d_:.3e}, cached steps {d_s:.3e}")
    assert worst <= 1e-4, f"the torch peer disagrees with the reference ({worst:.3e})"
    print("torch peer matches the golden f32 logits (prefill and cached steps) within 1e-4")


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def bench(a):
    dev = a.device
    torch.backends.cuda.matmul.allow_tf32 = False
    m = Spark(a.model, dev, torch.bfloat16, a.ctx)
    vocab = m.emb.shape[0]
    gen = torch.Generator(device=dev).manual_seed(42)
    rows = []
    with torch.inference_mode():
        if a.prompt > 0:
            v = []
            for rep in range(a.reps + 1):
                ids = torch.randint(3, vocab, (1, a.prompt), device=dev, generator=gen)
                pos = torch.arange(a.prompt, device=dev)[None]
                cache = m.new_cache(1)
                sync()
                t = time.perf_counter()
                m.forward(ids, pos, cache)[:, -1]
                sync()
                if rep:
                    v.append(a.prompt / (time.perf_counter() - t))
            rows.append(dict(test=f"pp{a.prompt}", batch=1, mode="eager", tok_s_median=statistics.median(v), tok_s_all=v))
        for b in [int(x) for x in a.batch.split(",")]:
            for mode in ("eager", "cuda-graph") if dev == "cuda" else ("eager",):
                try:
                    v = decode(m, a, b, mode, vocab, dev, gen)
                    rows.append(dict(test=f"tg{a.n_gen}", batch=b, mode=mode, tok_s_median=statistics.median(v), tok_s_all=v))
                except Exception as e:  # report and go on: the other modes still count
                    rows.append(dict(test=f"tg{a.n_gen}", batch=b, mode=mode, error=str(e)[:300]))
    for r in rows:
        r.update(peer="pytorch " + torch.__version__, device=torch.cuda.get_device_name(0) if dev == "cuda" else dev)
        print(json.dumps(r), flush=True)


def decode(m, a, b, mode, vocab, dev, gen):
    """Tokens per second of a.n_gen decode steps at batch b, per rep, after a 1-token prompt."""
    v = []
    L = a.n_gen + 2
    for rep in range(a.reps + 1):
        cache = m.new_cache(b)
        ids = torch.randint(3, vocab, (b, 1), device=dev, generator=gen)
        pos = torch.zeros((b, 1), dtype=torch.long, device=dev)
        if mode == "eager":
            m.forward(ids, pos, cache)
            sync()
            t = time.perf_counter()
            for i in range(a.n_gen):
                pos = pos + 1
                logits = m.forward(ids, pos, cache, mask_len=L)
                ids = logits[:, -1].argmax(-1, keepdim=True)
            sync()
        else:
            s_ids, s_pos = ids.clone(), pos.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    m.forward(s_ids, s_pos, cache, mask_len=L)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = m.forward(s_ids, s_pos, cache, mask_len=L)
            sync()
            t = time.perf_counter()
            for i in range(a.n_gen):
                s_pos.add_(1)
                graph.replay()
                s_ids.copy_(out[:, -1].argmax(-1, keepdim=True))
            sync()
        if rep:
            v.append(a.n_gen * b / (time.perf_counter() - t))
    return v


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model")
    ap.add_argument("-p", "--prompt", type=int, default=2048)
    ap.add_argument("-n", "--n-gen", type=int, default=128)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke test")
    ap.add_argument("--check-golden", metavar="DIR")
    a = ap.parse_args()
    if a.check_golden:
        check_golden(a.check_golden)
        return
    if not a.model:
        sys.exit("--model is required")
    bench(a)


if __name__ == "__main__":
    main()
