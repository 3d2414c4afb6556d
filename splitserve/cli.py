"""The `splitserve` command."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Optional

import typer
from rich.console import Console
from rich.table import Table

app = typer.Typer(help="splitserve: distributed LLM serving.", no_args_is_help=True, add_completion=False)
console = Console()

DEFAULT_DEMO_DIR = Path(os.environ.get("SPLITSERVE_DEMO_MODEL_DIR", "models/demo-llama"))


def _quiet_hf() -> None:
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@app.command("demo-model")
def demo_model(
    out: Path = typer.Option(..., "--out", help="Directory to write the model to."),
    arch: str = typer.Option("llama", help="llama | qwen2 | qwen3 | mistral"),
    hidden: int = typer.Option(256, help="Hidden size."),
    layers: int = typer.Option(4, help="Number of decoder layers."),
    heads: int = typer.Option(8, help="Attention heads."),
    kv_heads: int = typer.Option(4, help="Key/value heads (GQA)."),
    intermediate: int = typer.Option(704, help="MLP intermediate size."),
    vocab: int = typer.Option(512, help="Vocabulary size (>= 259 for the byte tokenizer)."),
    max_positions: int = typer.Option(2048, help="Max position embeddings."),
    seed: int = typer.Option(0, help="Weight-initialisation seed."),
    dtype: str = typer.Option("float32", help="float32 | bfloat16 | float16"),
    tie_embeddings: bool = typer.Option(False, help="Tie input and output embeddings."),
    bench: bool = typer.Option(False, help="Ignore size flags: the ~56M-parameter benchmark Llama."),
    overwrite: bool = typer.Option(False, help="Replace an existing directory."),
) -> None:
    """Write a randomly initialised Hugging Face model directory with a byte-level tokenizer."""
    _quiet_hf()
    from splitserve.demo_model import DemoModelSpec, bench_model_spec, build_demo_model

    try:
        spec = bench_model_spec() if bench else DemoModelSpec(
            arch=arch, hidden_size=hidden, num_layers=layers, num_heads=heads, num_kv_heads=kv_heads,
            intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=max_positions,
            seed=seed, dtype=dtype, tie_word_embeddings=tie_embeddings,
        )
        if bench:
            spec.seed, spec.dtype = seed, dtype
        path = build_demo_model(spec, out, overwrite=overwrite)
    except (ValueError, FileExistsError) as err:
        raise typer.BadParameter(str(err)) from None
    console.print(f"[green]model written to[/green] {path}")


def ensure_demo_model(path: Path = DEFAULT_DEMO_DIR) -> Path:
    """Build the default demo model once; later calls reuse it."""
    _quiet_hf()
    from splitserve.demo_model import DemoModelSpec, build_demo_model

    spec = DemoModelSpec(arch="llama", hidden_size=256, num_layers=4, num_heads=8, num_kv_heads=4,
                         intermediate_size=704, vocab_size=259, max_position_embeddings=2048,
                         initializer_range=0.2)  # vocab = the byte tokenizer's, so every id decodes
    return build_demo_model(spec, path)


@app.command()
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
    _quiet_hf()
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


@app.command("run-demo")
def run_demo(max_tokens: int = typer.Option(48)) -> None:
    """Build the demo model if missing and generate from a few prompts offline."""
    _quiet_hf()
    from workers.engine import LLM, SamplingParams

    model_dir = ensure_demo_model()
    console.print(f"demo model: {model_dir} (random weights: the text is noise, the tokens are exact)")
    llm = LLM(str(model_dir))
    prompts = ["Hello, splitserve!", "The capital of France is", "def fibonacci(n):", "Once upon a time"]
    _print_generations(llm, prompts, SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=0))


def main() -> None:
    logging.basicConfig(level=os.environ.get("SPLITSERVE_LOG_LEVEL", "WARNING"))
    app()


if __name__ == "__main__":
    main()
