"""Train a tiny LLaDA-style masked-diffusion model on digit-string reversal, on the CPU.

    .venv/bin/python scripts/train_tiny_dllm.py --out workers/diffusion/tiny_model
    .venv/bin/python scripts/train_tiny_dllm.py --out /tmp/tiny --quick    # seconds, a weak model

The task is workers/diffusion/tiny_task.py's (`<BOS>31415926=` -> `62951413` then EOS up to
the generated length). Training is LLaDA's SFT objective (its GUIDELINES.md, "SFT"): per
example the sequence is the prompt followed by the generated region (the answer padded with
EOS to the batch's generated length: 16, 24 and 32 in turn, so the model generates at any of
them), `t ~ U(0, 1)`, `p = (1 - eps) t + eps`, every token of the generated
region (EOS padding included) masked with probability `p` and the prompt never; the loss is
the cross-entropy on the masked positions weighted by `1 / p`, divided by the length of the
generated region, summed and averaged over the batch. Prompts of different lengths are
right-padded with their keys hidden (`attention_mask`), which leaves every real position
exactly as it is alone.

Reproducible: the initial weights are `splitserve demo-model --arch llada`'s (`build_demo_model`,
seeded), the data stream and the masks are seeded, one torch thread, deterministic algorithms:
the same settings give bit-identical weights on the same torch build.

The output directory is the demo model's layout (config.json with the LLaDA fields and
`mask_token_id`, `model.transformer.*` safetensors, the byte-level tokenizer that
`transformers.AutoTokenizer` loads) with two departures: `rope_theta` is 10000, not LLaDA-8B's
500000 (see TrainSettings), and the chat template renders a conversation as BOS plus the last
user message, the only format the model knows (tiny_task.CHAT_TEMPLATE). Beside it,
`tiny_dllm.json`: the settings and their digest, the training command and time, the held-out
accuracies measured with workers/diffusion/reference.py's `generate` on the model re-loaded
with `load_llada` from the directory as written, and the weights' sha256.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import math
import platform
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from splitserve.cli.demo_model import MARKER, DemoModelSpec, build_demo_model  # noqa: E402
from workers.diffusion import tiny_task  # noqa: E402
from workers.diffusion.reference import DiffusionParams, generate  # noqa: E402
from workers.engine.models.llada import CHECKPOINT_PREFIX, LladaModel, load_llada  # noqa: E402

METADATA = "tiny_dllm.json"
# Bump when the training code changes what a given TrainSettings produces.
TRAINER_VERSION = 1


@dataclass(frozen=True)
class TrainSettings:
    """Everything that determines the trained weights."""

    seed: int = 0
    # Model (LLaDA layout: GQA, SwiGLU of width mlp_hidden_size, untied LM head).
    d_model: int = 64
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 2
    mlp_hidden_size: int = 128
    max_sequence_length: int = 64
    # LLaDA-8B's 500000 leaves all but two or three of a 16-channel head's 8 RoPE frequencies
    # nearly still over these <= 46-token sequences; measured: after 600 steps at 16 generated
    # tokens, 500000 gave 0% held-out accuracy, 10000 gave 95%.
    rope_theta: float = 10000.0
    init_std: float = 0.02
    # Optimisation: AdamW, linear warm-up then cosine decay to min_lr_ratio * lr.
    steps: int = 1800
    batch_size: int = 64
    lr: float = 1e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 100
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    eps: float = 1e-3  # LLaDA's forward_process: p_mask = (1 - eps) * t + eps
    # Generated-region lengths trained on, taken in turn batch by batch (every answer padded
    # with EOS to the batch's length), so generation works at any of them.
    gen_lengths: tuple[int, ...] = tiny_task.TRAINED_GEN_LENGTHS

    def digest(self) -> str:
        """A hash of these settings, the trainer version and the task's definition."""
        task = dict(digits=(tiny_task.MIN_DIGITS, tiny_task.MAX_DIGITS), heldout_modulus=tiny_task.HELDOUT_MODULUS,
                    separator=tiny_task.SEPARATOR)
        payload = json.dumps({"trainer_version": TRAINER_VERSION, "task": task, **dataclasses.asdict(self)},
                             sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:16]


QUICK = dict(steps=150, batch_size=32, n_layers=2, warmup_steps=20, gen_lengths=(16,))

# Held-out evaluation: problems(n, EVAL_SEED, "heldout"); (gen_length, block_length, steps).
EVAL_SEED = 12345
EVAL_CONFIGS = (
    (16, 16, 16), (16, 4, 16),  # one token per step; one block, semi-autoregressive blocks of 4
    (16, 16, 8), (16, 16, 4), (16, 16, 2),  # 2, 4 and 8 tokens per step
    (32, 32, 32), (32, 8, 16), (32, 32, 8),  # a longer generated region (more EOS to fill)
)
QUICK_EVAL_CONFIGS = ((16, 16, 16),)


def demo_spec(settings: TrainSettings) -> DemoModelSpec:
    return DemoModelSpec(
        arch="llada",
        hidden_size=settings.d_model,
        num_layers=settings.n_layers,
        num_heads=settings.n_heads,
        num_kv_heads=settings.n_kv_heads,
        intermediate_size=settings.mlp_hidden_size,
        vocab_size=tiny_task.VOCAB_SIZE,
        max_position_embeddings=settings.max_sequence_length,
        seed=settings.seed,
        initializer_range=settings.init_std,
    )


def build_template(settings: TrainSettings, out: Path) -> Path:
    """The demo LLaDA directory for `settings` (config.json, seeded N(0, init_std) weights,
    tokenizer) with its rope_theta set to the settings'."""
    build_demo_model(demo_spec(settings), out)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["rope_theta"] = settings.rope_theta
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return out


def make_batch(stream, settings: TrainSettings, gen_length: int):
    """Clean sequences [B, T] (prompt + answer + EOS padding, then PAD), the answer-region
    mask [B, T] and the key mask [B, T] (False on the right padding)."""
    batch = [next(stream) for _ in range(settings.batch_size)]
    rows = [(p.prompt_ids, p.target_ids(gen_length)) for p in batch]
    length = max(len(prompt) + len(target) for prompt, target in rows)
    ids = torch.full((len(rows), length), tiny_task.PAD_ID, dtype=torch.long)
    answer = torch.zeros((len(rows), length), dtype=torch.bool)
    keys = torch.zeros((len(rows), length), dtype=torch.bool)
    for i, (prompt, target) in enumerate(rows):
        end = len(prompt) + len(target)
        ids[i, :end] = torch.tensor(prompt + target)
        answer[i, len(prompt):end] = True
        keys[i, :end] = True
    return ids, answer, keys


def sft_loss(model: LladaModel, ids, answer, keys, settings: TrainSettings, generator: torch.Generator):
    """LLaDA's SFT loss (GUIDELINES.md): answer tokens masked with probability p, CE / p on the
    masked ones, / answer length, summed, / batch."""
    batch, length = ids.shape
    t = torch.rand(batch, generator=generator)
    p_mask = ((1 - settings.eps) * t + settings.eps)[:, None].expand(batch, length)
    masked = (torch.rand((batch, length), generator=generator) < p_mask) & answer
    noisy = torch.where(masked, tiny_task.MASK_ID, ids)
    logits = model(noisy, attention_mask=keys)
    answer_lengths = answer.sum(dim=1, keepdim=True).expand(batch, length)
    token_loss = F.cross_entropy(logits[masked], ids[masked], reduction="none") / p_mask[masked]
    return (token_loss / answer_lengths[masked]).sum() / batch, int(masked.sum())


def learning_rate(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return settings.lr * (settings.min_lr_ratio + (1 - settings.min_lr_ratio) * cosine)


def train(model: LladaModel, settings: TrainSettings, log=print) -> None:
    model.train().requires_grad_(True)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr, betas=(0.9, 0.98), foreach=False,
    )
    stream = tiny_task.problem_stream(settings.seed, split="train")
    generator = torch.Generator().manual_seed(settings.seed)
    started, running = time.perf_counter(), 0.0
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, settings)
        gen_length = settings.gen_lengths[step % len(settings.gen_lengths)]
        ids, answer, keys = make_batch(stream, settings, gen_length)
        loss, _ = sft_loss(model, ids, answer, keys, settings, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        running = 0.98 * running + 0.02 * loss.item() if step else loss.item()
        if (step + 1) % max(1, settings.steps // 20) == 0 or step + 1 == settings.steps:
            log(f"step {step + 1:5d}/{settings.steps}  loss {running:.4f}  lr {learning_rate(step, settings):.2e}  "
                f"{time.perf_counter() - started:6.1f}s")
    model.eval().requires_grad_(False)


def checkpoint_tensors(model: LladaModel) -> dict[str, torch.Tensor]:
    """The model's weights under LLaDA's checkpoint names (what load_llada reads)."""
    return {CHECKPOINT_PREFIX + name.removeprefix("transformer."): p.detach().contiguous().clone()
            for name, p in model.named_parameters()}


def evaluate(model, n: int, configs=EVAL_CONFIGS, seed: int = EVAL_SEED, log=print) -> list[dict]:
    """Exact-match accuracy on `n` held-out problems with the reference generate (temperature
    0, low_confidence remasking) for each (gen_length, block_length, steps)."""
    problems = tiny_task.problems(n, seed, split="heldout")
    results = []
    for gen_length, block_length, steps in configs:
        params = DiffusionParams(gen_length=gen_length, block_length=block_length, steps=steps,
                                 temperature=0.0, remasking="low_confidence")
        started = time.perf_counter()
        outputs = generate(model, [p.prompt_ids for p in problems], params, mask_token_id=tiny_task.MASK_ID)
        correct = sum(tiny_task.is_correct(o.tokens, p) for o, p in zip(outputs, problems))
        results.append(dict(gen_length=gen_length, block_length=block_length, steps=steps, problems=n,
                            correct=correct, accuracy=correct / n))
        log(f"  gen_length {gen_length:3d}  block_length {block_length:3d}  steps {steps:3d}:  "
            f"{correct}/{n} = {correct / n:.1%}  ({time.perf_counter() - started:.1f}s)")
    return results


def write_model_dir(model: LladaModel, template_dir: Path, out: Path, metadata: dict) -> None:
    """`out` gets the template's config.json and tokenizer files, the trained weights and the
    metadata; written in a sibling temporary directory and moved into place at the end."""
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        for path in sorted(template_dir.iterdir()):
            if path.name not in ("model.safetensors", MARKER):
                shutil.copy2(path, staging / path.name)
        # The demo's chat template frames messages with role tags this model never saw.
        (staging / "chat_template.jinja").write_text(tiny_task.CHAT_TEMPLATE)
        save_file(checkpoint_tensors(model), str(staging / "model.safetensors"), metadata={"format": "pt"})
        weights_sha256 = hashlib.sha256((staging / "model.safetensors").read_bytes()).hexdigest()
        metadata = dict(metadata, weights_sha256=weights_sha256)
        (staging / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
        if out.exists():
            check_replaceable(out)
            shutil.rmtree(out)
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def check_replaceable(out: Path) -> None:
    """Only an empty directory or one this script wrote may be replaced."""
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or (out / METADATA).is_file())):
        raise SystemExit(f"{out} exists and is not a model directory this script wrote ({METADATA}); "
                         "not replacing it")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, type=Path, help="model directory to write (replaced if present)")
    ap.add_argument("--seed", type=int, default=TrainSettings.seed)
    ap.add_argument("--steps", type=int, default=None, help=f"optimiser steps (default {TrainSettings.steps})")
    ap.add_argument("--quick", action="store_true", help=f"a fast, weak variant for tests: {QUICK}")
    ap.add_argument("--eval-problems", type=int, default=None,
                    help="held-out problems per evaluation setting (default 200, 20 with --quick)")
    args = ap.parse_args(argv)

    check_replaceable(args.out)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    overrides = dict(QUICK) if args.quick else {}
    overrides["seed"] = args.seed
    if args.steps is not None:
        overrides["steps"] = args.steps
    settings = TrainSettings(**overrides)
    n_eval = args.eval_problems if args.eval_problems is not None else (20 if args.quick else 200)
    print(f"settings {settings.digest()}: {dataclasses.asdict(settings)}", flush=True)

    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        template = build_template(settings, Path(tmp) / "init")
        model = load_llada(template)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"model: {n_params:,} parameters", flush=True)
        train(model, settings, log=lambda line: print(line, flush=True))
        train_seconds = time.perf_counter() - started
        metadata = dict(
            task="digit-string reversal (workers/diffusion/tiny_task.py)",
            command="scripts/train_tiny_dllm.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            trainer_version=TRAINER_VERSION, settings=dataclasses.asdict(settings), settings_digest=settings.digest(),
            quick=args.quick, parameters=n_params, train_seconds=round(train_seconds, 1),
            torch=torch.__version__, python=platform.python_version(),
        )
        write_model_dir(model, template, args.out, metadata)

    print(f"trained in {train_seconds:.1f}s; evaluating the written model on {n_eval} held-out problems:", flush=True)
    loaded = load_llada(args.out)
    eval_started = time.perf_counter()
    configs = QUICK_EVAL_CONFIGS if args.quick else EVAL_CONFIGS
    results = evaluate(loaded, n_eval, configs, log=lambda line: print(line, flush=True))
    metadata = json.loads((args.out / METADATA).read_text())
    metadata.update(eval_seed=EVAL_SEED, eval_seconds=round(time.perf_counter() - eval_started, 1), accuracy=results)
    (args.out / METADATA).write_text(json.dumps(metadata, indent=2) + "\n")
    print(f"wrote {args.out} ({(args.out / 'model.safetensors').stat().st_size / 1e6:.2f} MB weights) "
          f"in {time.perf_counter() - started:.1f}s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
