#!/usr/bin/env python3
"""PyTorch baselines for `trainer bench --baseline pytorch`: DistributedDataParallel and DTensor
tensor parallelism.

Trains the same LLaMA 3 model (same configuration, data and global batch) that weft trains, in
plain PyTorch: DDP over Gloo on the CPU, or over NCCL with rank r on cuda:r when run.json's device
is "cuda" (autocast on that device, step times measured after torch.cuda.synchronize), so weft's
throughput can be compared with what a user would otherwise run. With --parallel tp the model is
split instead by PyTorch's own tensor parallelism (torch.distributed.tensor.parallel, PyTorch >=
2.4): parallelize_module with ColwiseParallel on q/k/v/gate/up, RowwiseParallel on o/down, the
embedding split by vocabulary (RowwiseParallel) and the LM head's logits left sharded for
loss_parallel, every rank on the whole global batch (Megatron's layout, as tensor_parallel.so).
With --parallel pp the processes are the stages of one pipeline run by torch.distributed.pipelining
(PyTorch >= 2.4): --schedule gpipe (ScheduleGPipe), 1f1b (Schedule1F1B) or interleaved1f1b
(ScheduleInterleaved1F1B, two stages per process), each step's rows cut into --microbatches
micro-batches; the layers are split as evenly as their count allows, the first stage holding the embedding and the last the
norm and head (tied embeddings: the two copies' gradients summed). Standard library + torch only; trainer bench runs it with the Python of
tools/setup.sh's virtual environment (PyTorch's wheel; WEFT_PYTHON chooses another). Attention is
F.scaled_dot_product_attention, as transformers' default.

With --model transformers (DDP only) the model is transformers' own LlamaForCausalLM loaded from
run.json's weights (the job's checkpoint: a GGUF file dequantized as transformers loads it, an HF
folder or a safetensors file), with PEFT's LoRA (get_peft_model with run.json's r, alpha, dropout
and target modules) when run.json's mode is "lora": what a user runs instead of weft.

  ~/.cache/weft/venv/bin/python python/pytorch_baseline.py --data DIR --nproc N --out RUN_DIR [--steps K]
      [--parallel ddp|tp|pp] [--schedule gpipe|1f1b|interleaved1f1b] [--microbatches M]
      [--model llama|transformers]

Inputs (DIR, written by trainer bench):
  config.json  a Hugging Face LLaMA config.json (head_dim, rope_scaling optional)
  tokens.u32   the training split, raw little-endian uint32 tokens; sequence i is
               tokens[i*L : i*L + L + 1] (inputs are its first L, targets its last L)
  order.u32    optional: the sequence at each global batch position, in weft's order (uint32)
  run.json     seq_len, batch_size (global sequences per micro-batch), grad_accum_steps, lr,
               weight_decay, beta1, beta2, eps, warmup_steps, grad_clip (0 = off), seed, steps,
               threads (intra-op threads per process), precision ("fp32", "bf16" or "fp16": autocast
               over fp32 weights, fp16 with torch.amp.GradScaler), device ("cpu", the default, or
               "cuda"); for --model transformers also mode ("full" or "lora"), weights (a path, "" =
               transformers' initialisation) and lora (r, alpha, dropout, target_modules)

Output: RUN_DIR/metrics.jsonl in weft's format: one {"type": "step", ...} line per optimizer step
(loss averaged over the global batch, step_time_s and tokens_per_s measured on rank 0, and the
step's forward_s and backward_s: the time in the forward passes, loss included, and in the backward
passes, summed over its micro-batches; not for a pipeline, whose schedule interleaves them) and one
{"type": "summary", ...} line with overall tokens/s and peak resident memory of every rank (and,
on CUDA, peak device memory allocated and reserved).
Exit status 0 on success; otherwise 1 with a one-line message on stderr.
"""
import argparse
import contextlib
import json
import math
import os
import resource
import statistics
import sys
import time
from array import array

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

RUN_KEYS = ("seq_len", "batch_size", "grad_accum_steps", "lr", "weight_decay", "beta1", "beta2",
            "eps", "warmup_steps", "grad_clip", "seed", "steps", "threads", "precision")


class BaselineError(Exception):
    """A problem with the inputs, reported as one line."""


# ----------------------------------------------------------------------------- model

def rope_inv_freq(cfg, head_dim):
    """HF inverse frequencies, with Llama-3 rope_scaling applied when the config has it."""
    inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    rs = cfg.get("rope_scaling")
    if not rs or rs.get("rope_type", rs.get("type", "default")) == "default":
        return inv_freq.float()
    factor, low, high = rs.get("factor", 8.0), rs.get("low_freq_factor", 1.0), rs.get("high_freq_factor", 4.0)
    old_ctx = rs.get("original_max_position_embeddings", 8192)
    wavelen = 2 * math.pi / inv_freq
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = torch.where(wavelen > old_ctx / low, inv_freq / factor, inv_freq)
    medium = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    scaled = torch.where(medium, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    return scaled.float()


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class Block(nn.Module):
    def __init__(self, cfg, head_dim):
        super().__init__()
        c, i = cfg["hidden_size"], cfg["intermediate_size"]
        self.n_heads, self.n_kv, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], head_dim
        self.input_layernorm = RMSNorm(c, cfg["rms_norm_eps"])
        self.q_proj = nn.Linear(c, self.n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(c, self.n_kv * head_dim, bias=False)
        self.v_proj = nn.Linear(c, self.n_kv * head_dim, bias=False)
        self.o_proj = nn.Linear(self.n_heads * head_dim, c, bias=False)
        self.post_attention_layernorm = RMSNorm(c, cfg["rms_norm_eps"])
        self.gate_proj = nn.Linear(c, i, bias=False)
        self.up_proj = nn.Linear(c, i, bias=False)
        self.down_proj = nn.Linear(i, c, bias=False)

    def attention(self, x, cos, sin):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        q = q * cos.to(q.dtype) + rotate_half(q) * sin.to(q.dtype)
        k = k * cos.to(k.dtype) + rotate_half(k) * sin.to(k.dtype)
        if self.n_heads != self.n_kv:  # grouped-query attention: HF repeat_kv
            k = k.repeat_interleave(self.n_heads // self.n_kv, dim=1)
            v = v.repeat_interleave(self.n_heads // self.n_kv, dim=1)
        # the fused kernel (transformers' default attn_implementation "sdpa")
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x, cos, sin):
        x = x + self.attention(self.input_layernorm(x), cos, sin)
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        c, v = cfg["hidden_size"], cfg["vocab_size"]
        head_dim = cfg.get("head_dim") or c // cfg["num_attention_heads"]
        self.embed_tokens = nn.Embedding(v, c)
        self.layers = nn.ModuleList(Block(cfg, head_dim) for _ in range(cfg["num_hidden_layers"]))
        self.norm = RMSNorm(c, cfg["rms_norm_eps"])
        self.lm_head = nn.Linear(c, v, bias=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if cfg.get("tie_word_embeddings", False):
            self.lm_head.weight = self.embed_tokens.weight
        self.register_buffer("inv_freq", rope_inv_freq(cfg, head_dim), persistent=False)

    def forward(self, tokens, targets):
        logits = self.logits(tokens)
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    def logits(self, tokens):
        t = tokens.shape[1]
        freqs = torch.outer(torch.arange(t, dtype=torch.float32, device=tokens.device), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


def tensor_parallel(model, cfg, world):
    """Splits `model` over all `world` processes with PyTorch's DTensor tensor parallelism:
    Megatron's layout (column-parallel q/k/v/gate/up, row-parallel o/down, a vocabulary-parallel
    embedding and LM head whose logits stay sharded for loss_parallel). Returns the loss function
    for (model, tokens, targets). Raises BaselineError where this PyTorch or the model cannot."""
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, loss_parallel,
                                                       parallelize_module)
    except ImportError as e:
        raise BaselineError(f"--parallel tp needs PyTorch >= 2.4 (torch.distributed.tensor.parallel with "
                            f"loss_parallel); this is PyTorch {torch.__version__} ({e})")
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    for key, value in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads),
                       ("intermediate_size", cfg["intermediate_size"]), ("vocab_size", cfg["vocab_size"])):
        if value % world:
            raise BaselineError(f"--parallel tp over {world} processes: {key} = {value} does not divide")
    mesh = init_device_mesh(next(model.parameters()).device.type, (world,))
    tied = model.lm_head.weight is model.embed_tokens.weight
    if tied:  # split each, then tie the two vocabulary-sharded weights again
        model.lm_head.weight = nn.Parameter(model.embed_tokens.weight.detach().clone())
    for layer in model.layers:
        layer.n_heads, layer.n_kv = heads // world, kv_heads // world  # each rank's heads
        parallelize_module(layer, mesh, {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(),
                                         "v_proj": ColwiseParallel(), "o_proj": RowwiseParallel(),
                                         "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
                                         "down_proj": RowwiseParallel()})
    parallelize_module(model, mesh, {"embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                     "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)})
    if tied:
        model.lm_head.weight = model.embed_tokens.weight

    def loss(model, tokens, targets):
        logits = model.logits(tokens)
        with loss_parallel():
            return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    return loss, loss_parallel


def transformers_model(cfg, run):
    """transformers' LlamaForCausalLM on run.json's weights (a GGUF file, dequantized as
    transformers loads one; a safetensors file or an HF model folder; none: transformers' own
    initialisation of config.json's shape), attention by SDPA, no KV cache; for mode "lora", PEFT's
    LoRA on run.json's target modules (r, alpha, dropout): what a user runs instead of weft.
    Returns (model, loss function of (model, tokens, targets))."""
    mode = run.get("mode", "full")
    if mode not in ("full", "lora"):
        raise BaselineError(f"--model transformers trains train.mode full or lora, not {mode!r}")
    try:
        import transformers
    except ImportError as e:
        raise BaselineError(f"--model transformers needs transformers ({e})")
    weights = run.get("weights", "")
    options = {"dtype": torch.float32, "attn_implementation": "sdpa"}
    if not weights:
        config = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
        config._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(config)
    elif weights.endswith(".gguf"):
        import gguf_memo  # this folder's: the file's metadata parsed once, where transformers parses it twice

        gguf_memo.install()
        model = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(weights),
                                                                  gguf_file=os.path.basename(weights), **options)
    elif os.path.isdir(weights):
        model = transformers.AutoModelForCausalLM.from_pretrained(weights, **options)
    else:  # one safetensors file: the shape from config.json
        from safetensors.torch import load_file
        config = transformers.LlamaConfig(**{k: v for k, v in cfg.items() if k != "architectures"})
        config._attn_implementation = "sdpa"
        model = transformers.LlamaForCausalLM(config)
        model.load_state_dict(load_file(weights), strict=False)
    if model.config.vocab_size != cfg["vocab_size"] or model.config.hidden_size != cfg["hidden_size"]:
        raise BaselineError(f"{weights}: transformers reads vocab {model.config.vocab_size}, hidden "
                            f"{model.config.hidden_size}; weft's job has {cfg['vocab_size']}, {cfg['hidden_size']}")
    model.config.use_cache = False
    model.train()
    if mode == "lora":
        try:
            import peft
        except ImportError as e:
            raise BaselineError(f"--model transformers with train.mode lora needs peft ({e})")
        lora = run["lora"]
        model = peft.get_peft_model(model, peft.LoraConfig(r=lora["r"], lora_alpha=lora["alpha"],
                                                           lora_dropout=lora["dropout"],
                                                           target_modules=list(lora["target_modules"]),
                                                           bias="none", task_type="CAUSAL_LM"))

    def loss(model, tokens, targets):  # transformers' ForCausalLMLoss on logits upcast to fp32
        logits = model(input_ids=tokens).logits
        return F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.reshape(-1))

    return model, loss


def clip_split_grad_norm(parameters, clip):
    """clip_grad_norm_ for a model that DTensor splits only partly (its norms stay plain tensors,
    which PyTorch's foreach norm refuses to mix with DTensors): the squares of the sharded
    gradients summed over the processes, the replicated ones' counted once. Returns the norm."""
    sharded, plain = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    grads = [p.grad for p in parameters if p.grad is not None]
    for g in grads:
        if hasattr(g, "to_local") and any(placement.is_shard() for placement in g.placements):
            sharded += g.to_local().double().pow(2).sum().cpu()
        else:  # a plain tensor, or a replicated DTensor (the embedding's gradient), whole on every rank
            plain += (g.full_tensor() if hasattr(g, "full_tensor") else g).double().pow(2).sum().cpu()
    dist.all_reduce(sharded)
    norm = math.sqrt(float(sharded + plain))
    if norm > clip:
        for g in grads:
            g.mul_(clip / (norm + 1e-6))
    return norm


PIPELINE_SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b")


class StagePart(nn.Module):
    """Layers `layers` of `model` (and its embedding on the first stage, its norm and head on the
    last): one pipeline stage, hidden states in and out between stages."""

    def __init__(self, model, first, last, layers):
        super().__init__()
        self.embed_tokens = model.embed_tokens if first else None
        self.layers = nn.ModuleList(model.layers[i] for i in layers)
        self.norm = model.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.register_buffer("inv_freq", model.inv_freq, persistent=False)

    def forward(self, x):
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        freqs = torch.outer(torch.arange(x.shape[1], dtype=torch.float32, device=x.device), self.inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x)) if self.lm_head is not None else x


def pipeline_virtual_stages(schedule):
    """Stages per process of a pipeline schedule (interleaved 1F1B: two)."""
    return 2 if schedule == "interleaved1f1b" else 1


def check_pipeline(cfg, world, schedule):
    """A pipeline the model cannot fill, refused before any process starts."""
    virtual, layers = pipeline_virtual_stages(schedule), cfg["num_hidden_layers"]
    if layers < world * virtual:
        raise BaselineError(f"--parallel pp: {layers} layers cannot fill {world * virtual} stages ({world} processes x "
                            f"{virtual})")


class Pipeline:
    """This process's stages of one pipeline over all `world` processes, run by PyTorch's own
    schedule. `step(inputs, targets)` runs one accumulation micro-batch (forward and backward of
    its micro-batches; the loss divided by `accumulation`) and returns its loss on the last
    process (0 elsewhere); after the last, `finish()` sums tied embeddings' gradients and returns
    the squared gradient norm over all processes."""

    def __init__(self, model, cfg, world, rank, schedule, microbatches, accumulation, device):
        try:
            from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleGPipe,
                                                      ScheduleInterleaved1F1B)
        except ImportError as e:
            raise BaselineError(f"--parallel pp needs PyTorch >= 2.4 (torch.distributed.pipelining); this is "
                                f"PyTorch {torch.__version__} ({e})")
        virtual = pipeline_virtual_stages(schedule)
        stages, layers = world * virtual, cfg["num_hidden_layers"]
        self.rank, self.world = rank, world
        self.tied = model.lm_head.weight is model.embed_tokens.weight
        self.parts, pipeline_stages = [], []
        for v in range(virtual):
            index = v * world + rank  # Megatron's interleaving: process r holds stages r, r + world, ...
            span = range(index * layers // stages, (index + 1) * layers // stages)  # as even as the count allows
            part = StagePart(model, index == 0, index == stages - 1, span).to(device)
            self.parts.append(part)
            pipeline_stages.append(PipelineStage(part, index, stages, device))
        self.module = nn.ModuleList(self.parts)  # what this process trains
        self.tie_group = dist.new_group([0, world - 1]) if self.tied and world > 1 else None

        def loss_fn(output, targets):
            return F.cross_entropy(output.float().reshape(-1, output.shape[-1]), targets.reshape(-1)) / accumulation

        if virtual > 1:
            self.schedule = ScheduleInterleaved1F1B(pipeline_stages, microbatches, loss_fn=loss_fn)
        else:
            kind = ScheduleGPipe if schedule == "gpipe" else Schedule1F1B
            self.schedule = kind(pipeline_stages[0], microbatches, loss_fn=loss_fn)

    def step(self, inputs, targets):
        last = self.rank == self.world - 1
        losses = [] if last else None
        if self.rank == 0:
            self.schedule.step(inputs, target=targets if last else None, losses=losses)
        elif last:
            self.schedule.step(target=targets, losses=losses)
        else:
            self.schedule.step()
        return float(torch.stack(losses).sum() / len(losses)) if last else 0.0  # each is 1/accumulation of a mean

    def finish(self):
        tied_weight = None
        if self.tied and self.rank in (0, self.world - 1):
            tied_weight = self.parts[0].embed_tokens.weight if self.rank == 0 else self.parts[-1].lm_head.weight
            if tied_weight.grad is None:
                tied_weight.grad = torch.zeros_like(tied_weight)
            if self.tie_group is not None:
                dist.all_reduce(tied_weight.grad, group=self.tie_group)
        square = torch.zeros((), dtype=torch.float64)
        for p in self.module.parameters():
            if p.grad is not None and not (p is tied_weight and self.rank != 0):  # the tied copy counted once
                square += p.grad.double().pow(2).sum().cpu()
        dist.all_reduce(square)
        return float(square)


def local_value(t):
    """A plain tensor's, or a replicated DTensor's, value as a Python float."""
    return float(t.full_tensor() if hasattr(t, "full_tensor") else t)


# ----------------------------------------------------------------------------- data

def load_tokens(path):
    """The token stream as an int32 tensor over the file's bytes (tokens < 2^31)."""
    data = array("I")
    with open(path, "rb") as f:
        data.fromfile(f, os.path.getsize(path) // 4)
    if sys.byteorder != "little":
        data.byteswap()
    return torch.frombuffer(data, dtype=torch.int32) if len(data) else torch.empty(0, dtype=torch.int32)


class Batches:
    """Global sequence position p -> sequence order[p] where weft's order is given (order.u32: the
    trainer's own batches), else perm_e[p % n] with e = p // n, where perm_e is a permutation of
    range(n) drawn from a torch.Generator seeded with seed + e."""

    def __init__(self, tokens, seq_len, seed, order=None):
        self.tokens, self.seq_len, self.seed, self.order = tokens, seq_len, seed, order
        self.n = (tokens.numel() - 1) // seq_len
        self.epoch, self.perm = -1, None

    def sequence(self, position):
        if self.order is not None and position < self.order.numel():
            start = int(self.order[position]) * self.seq_len
            return self.tokens[start:start + self.seq_len + 1]
        epoch = position // self.n
        if epoch != self.epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self.epoch, self.perm = epoch, torch.randperm(self.n, generator=g)
        start = int(self.perm[position % self.n]) * self.seq_len
        return self.tokens[start:start + self.seq_len + 1]

    def rows(self, first, count):
        seqs = torch.stack([self.sequence(first + j) for j in range(count)]).long()
        return seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()


# ----------------------------------------------------------------------------- training

class NoScaler:
    """GradScaler's interface doing nothing (fp32, bf16)."""

    def scale(self, loss):
        return loss

    def unscale_(self, optimizer):
        pass

    def step(self, optimizer):
        optimizer.step()

    def update(self):
        pass


def peak_rss_mib():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def worker(rank, world, port, cfg, run, data_dir, out_dir, parallel="ddp", schedule="1f1b", microbatches=4,
           model_kind="llama"):
    torch.set_num_threads(run["threads"])
    torch.manual_seed(run["seed"])
    cuda = run.get("device", "cpu") == "cuda"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        if rank >= torch.cuda.device_count():
            raise BaselineError(f"rank {rank} needs cuda:{rank}, but {torch.cuda.device_count()} CUDA devices are visible")
        torch.cuda.set_device(device)
    if world > 1:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False)  # the parent's (main)
        dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)
    loss_of, backward_context, pipeline = (lambda m, x, y: m(x, y)), contextlib.nullcontext, None
    if model_kind == "transformers":
        model, loss_of = transformers_model(cfg, run)
        model = model.to(device)
    else:
        model = Llama(cfg).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    n_trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    split = parallel == "tp" and world > 1
    L, B, G = run["seq_len"], run["batch_size"], run["grad_accum_steps"]
    if parallel == "pp":
        if world < 2:
            raise BaselineError("--parallel pp needs 2 or more processes (the pipeline's stages)")
        if B % microbatches:
            raise BaselineError(f"--microbatches {microbatches} does not divide the batch of {B} rows")
        pipeline = Pipeline(model, cfg, world, rank, schedule, microbatches, G, device)
        model = pipeline.module
    elif split:
        loss_of, backward_context = tensor_parallel(model, cfg, world)
    elif world > 1:
        model = DDP(model, device_ids=[rank] if cuda else None)
    whole_batch = split or pipeline is not None  # every rank (every stage) sees the whole batch
    local_b = B if whole_batch else B // world
    order_path = os.path.join(data_dir, "order.u32")
    batches = Batches(load_tokens(os.path.join(data_dir, "tokens.u32")), L, run["seed"],
                      load_tokens(order_path) if os.path.exists(order_path) else None)
    params = [p for p in model.parameters() if p.requires_grad]
    # AdamW's fused kernel (one pass over each tensor) where it takes the tensors: transformers'
    # Trainer default (optim "adamw_torch_fused"), and what weft steps fp32 tensors with. tp's
    # DTensors keep PyTorch's default step.
    fused = not split and all(type(p) is torch.nn.Parameter and p.dtype == torch.float32 and
                              p.device.type in ("cpu", "cuda") for p in params)
    opt = torch.optim.AdamW(params, lr=run["lr"], betas=(run["beta1"], run["beta2"]), eps=run["eps"],
                            weight_decay=run["weight_decay"], fused=True if fused else None)
    half = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(run["precision"])
    autocast = (lambda: torch.autocast(device.type, dtype=half)) if half is not None else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device.type) if run["precision"] == "fp16" else NoScaler()
    synchronize = torch.cuda.synchronize if cuda else (lambda: None)
    tokens_per_step, warmup = B * G * L, run["warmup_steps"]
    metrics = open(os.path.join(out_dir, "metrics.jsonl"), "w") if rank == 0 else None
    if rank == 0:
        kind = (f"torch.distributed.pipelining {schedule}, {microbatches} micro-batches" if pipeline else
                "DTensor tensor parallelism" if split else "DDP")
        if model_kind == "transformers":
            kind = f"transformers {transformers_version()}" + (
                f" + PEFT {peft_version()} LoRA" if run.get("mode") == "lora" else "") + f", {kind}"
        print(f"pytorch baseline ({kind}): {n_params:,} parameters ({n_trained:,} trained), "
              f"{world} process(es), {run['threads']} thread(s) "
              f"each, {batches.n} sequences of {L}, {tokens_per_step} tokens per step, {run['precision']}",
              flush=True)
    times = []
    for step in range(run["steps"]):
        synchronize()
        start = time.perf_counter()
        lr = run["lr"] * min(1.0, (step + 1) / warmup) if warmup > 0 else run["lr"]
        for group in opt.param_groups:
            group["lr"] = lr
        local_loss = forward_s = backward_s = 0.0
        for m in range(G):
            first = (step * G + m) * B + (0 if whole_batch else rank * local_b)
            inputs, targets = batches.rows(first, local_b)
            inputs, targets = inputs.to(device, non_blocking=True), targets.to(device, non_blocking=True)
            if pipeline is not None:
                with autocast():
                    local_loss += pipeline.step(inputs, targets)
                continue
            sync = split or world == 1 or m == G - 1
            with (contextlib.nullcontext() if sync else model.no_sync()):
                synchronize()
                t0 = time.perf_counter()
                with autocast():
                    loss = loss_of(model, inputs, targets) / G
                synchronize()
                t1 = time.perf_counter()
                with backward_context():
                    scaler.scale(loss).backward()
                synchronize()
                forward_s, backward_s = forward_s + t1 - t0, backward_s + time.perf_counter() - t1
            local_loss += local_value(loss.detach())
        clip = run["grad_clip"] if run["grad_clip"] > 0 else float("inf")
        scaler.unscale_(opt)
        if pipeline is not None:
            grad_norm = math.sqrt(pipeline.finish())
            if grad_norm > clip:
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(clip / (grad_norm + 1e-6))
        elif split:
            grad_norm = clip_split_grad_norm(list(model.parameters()), clip)
        else:
            grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
        scaler.step(opt)
        scaler.update()
        opt.zero_grad(set_to_none=True)
        synchronize()
        elapsed = time.perf_counter() - start
        if world > 1 and not split:  # the global-batch mean, outside the timed region (tp: every rank's)
            t = torch.tensor([local_loss], dtype=torch.float64, device=device)
            dist.all_reduce(t)
            local_loss = t.item() / (1 if pipeline else world)  # a pipeline: the last stage's alone
        if rank == 0:
            times.append(elapsed)
            record = {"type": "step", "step": step + 1, "epoch": 1, "loss": local_loss, "lr": lr,
                      "grad_norm": grad_norm, "step_time_s": elapsed, "tokens_per_s": tokens_per_step / elapsed,
                      "time": time.time()}
            if pipeline is None:
                record.update(forward_s=forward_s, backward_s=backward_s)
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
            if not math.isfinite(local_loss):
                raise BaselineError(f"loss became {local_loss} at step {step + 1}")
            if (step + 1) % 10 == 0:
                print(f"step {step + 1}/{run['steps']}: loss {local_loss:.4f}, "
                      f"{tokens_per_step / elapsed:.0f} tokens/s", flush=True)
    rss = [peak_rss_mib()] * world
    if world > 1:
        dist.all_gather_object(rss, peak_rss_mib())
    if rank == 0:
        total = sum(times)
        summary = {"type": "summary", "steps": run["steps"], "steps_per_epoch": batches.n // (B * G),
                   "tokens_per_s": tokens_per_step * len(times) / total if total > 0 else 0.0,
                   "peak_rss_mib": rss[0], "peak_rss_mib_per_rank": rss, "world_size": world,
                   "parameters": n_params, "trained_parameters": n_trained, "model": model_kind,
                   "torch_version": torch.__version__, "device": str(device),
                   "precision": run["precision"], "parallel": parallel if world > 1 else "ddp", "time": time.time()}
        if pipeline is not None:
            summary.update(schedule=schedule, microbatches=microbatches)
        if model_kind == "transformers":
            summary.update(transformers_version=transformers_version(), mode=run.get("mode", "full"))
            if run.get("mode") == "lora":
                summary["peft_version"] = peft_version()
        if cuda:
            summary["device_name"] = torch.cuda.get_device_name(device)
            summary["device_peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
            summary["device_peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / 2**20
        metrics.write(json.dumps(summary) + "\n")
        metrics.close()
        median = statistics.median(times) if times else 0.0
        print(f"pytorch baseline: {world} processes, {summary['tokens_per_s']:.0f} tokens/s "
              f"(median step {median:.3f} s)", flush=True)
    if world > 1:
        dist.barrier()


def transformers_version():
    import transformers
    return transformers.__version__


def peft_version():
    import peft
    return peft.__version__


def spawned(rank, world, port, cfg, run, data_dir, out_dir, errors, parallel="ddp", schedule="1f1b", microbatches=4,
            model_kind="llama"):
    """mp.spawn entry point. Leaves with os._exit, so that tearing down DDP's Gloo process group at
    interpreter exit cannot hang the parent (an older torch deadlocked there: its worker thread
    waited for the GIL that the joining main thread held). A failure goes to the parent through
    `errors`."""
    code = 0
    try:
        worker(rank, world, port, cfg, run, data_dir, out_dir, parallel, schedule, microbatches, model_kind)
    except BaseException as e:  # noqa: BLE001 - reported by the parent as one line
        first = (str(e).strip().splitlines() or [""])[0]
        errors.put(f"rank {rank}: {first}" if isinstance(e, BaselineError) else
                   f"rank {rank}: {type(e).__name__}: {first}")
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# ----------------------------------------------------------------------------- driver

def read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise BaselineError(f"cannot read {path}: {e}")


def load_inputs(data_dir, nproc, steps, parallel="ddp"):
    cfg, run = read_json(os.path.join(data_dir, "config.json")), read_json(os.path.join(data_dir, "run.json"))
    missing = [k for k in RUN_KEYS if k not in run]
    if missing:
        raise BaselineError(f"{data_dir}/run.json lacks {', '.join(missing)}")
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        if not isinstance(cfg.get(key), int) or cfg[key] <= 0:
            raise BaselineError(f"{data_dir}/config.json: {key} must be a positive integer")
    cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
    cfg.setdefault("rms_norm_eps", 1e-5)
    cfg.setdefault("rope_theta", 10000.0)
    if cfg["num_attention_heads"] % cfg["num_key_value_heads"]:
        raise BaselineError("num_attention_heads is not a multiple of num_key_value_heads")
    if steps is not None:
        run["steps"] = steps
    if run["precision"] not in ("fp32", "bf16"):
        raise BaselineError(f"precision must be fp32 or bf16, got {run['precision']!r}")
    if nproc < 1 or (parallel == "ddp" and run["batch_size"] % nproc):  # tp and pp: every rank the whole batch
        raise BaselineError(f"batch_size {run['batch_size']} is not divisible by nproc {nproc}")
    if run["steps"] < 1 or run["grad_accum_steps"] < 1 or run["seq_len"] < 1 or run["threads"] < 1:
        raise BaselineError("steps, grad_accum_steps, seq_len and threads must be positive")
    n_tokens = os.path.getsize(os.path.join(data_dir, "tokens.u32")) // 4
    if (n_tokens - 1) // run["seq_len"] < 1:
        raise BaselineError(f"{data_dir}/tokens.u32 holds {n_tokens} tokens: not one sequence of {run['seq_len']}")
    return cfg, run


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data", required=True, help="directory with config.json, tokens.u32, run.json")
    parser.add_argument("--nproc", type=int, default=1, help="number of DDP processes")
    parser.add_argument("--out", required=True, help="run directory for metrics.jsonl")
    parser.add_argument("--steps", type=int, help="optimizer steps (overrides run.json)")
    parser.add_argument("--parallel", choices=("ddp", "tp", "pp"), default="ddp",
                        help="DistributedDataParallel (ddp), DTensor tensor parallelism over all processes (tp), or "
                             "one pipeline whose stages are the processes (pp)")
    parser.add_argument("--schedule", choices=PIPELINE_SCHEDULES, default="1f1b", help="the pipeline's schedule (pp)")
    parser.add_argument("--microbatches", type=int, default=4, help="micro-batches per pipeline step (pp)")
    parser.add_argument("--model", choices=("llama", "transformers"), default="llama",
                        help="this file's Llama from random weights, every weight trained (llama), or transformers' "
                             "LlamaForCausalLM on run.json's weights with PEFT's LoRA for mode lora (transformers; "
                             "ddp only)")
    args = parser.parse_args()
    try:
        cfg, run = load_inputs(args.data, args.nproc, args.steps, args.parallel)
        os.makedirs(args.out, exist_ok=True)
        if args.microbatches < 1:
            raise BaselineError(f"--microbatches {args.microbatches}: must be >= 1")
        if args.parallel == "pp":
            check_pipeline(cfg, args.nproc, args.schedule)
        if args.model == "transformers" and args.parallel != "ddp":
            raise BaselineError("--model transformers runs under --parallel ddp only")
        if args.nproc == 1:
            worker(0, 1, 0, cfg, run, args.data, args.out, args.parallel, args.schedule, args.microbatches, args.model)
        else:
            errors = mp.get_context("spawn").SimpleQueue()
            # The ranks' store, hosted here on a port the kernel picks while it listens: a port found
            # free and bound later by a rank could be taken in between (by another run's ranks).
            store = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
            try:
                mp.spawn(spawned, args=(args.nproc, store.port, cfg, run, args.data, args.out, errors, args.parallel,
                                        args.schedule, args.microbatches, args.model),
                         nprocs=args.nproc, join=True)
            except Exception as e:  # a child failed: prefer its own message to "exited with code 1"
                raise BaselineError(errors.get() if not errors.empty() else str(e)) from e
    except Exception as e:  # noqa: BLE001 - one line for the caller, whatever failed
        lines = [l.strip() for l in str(e).splitlines() if l.strip()]
        print(f"pytorch_baseline: error: {lines[0] if lines else type(e).__name__}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
