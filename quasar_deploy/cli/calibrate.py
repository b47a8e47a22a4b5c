"""``quasar-deploy calibrate``: float checkpoint in, W8A8 artifact out, with the per-group smoothing table."""

from __future__ import annotations

import click


@click.command()
@click.argument("model_dir", type=click.Path(file_okay=False, path_type=str))
@click.option("--output", "-o", required=True, type=click.Path(path_type=str), help="New directory for the W8A8 artifact.")
@click.option("--calib-data", type=click.Path(dir_okay=False), help="JSONL (text/turns/inputs_pretokenized) or plain text.")
@click.option("--num-samples", default=64, show_default=True, type=click.IntRange(min=1))
@click.option("--seq-len", default=512, show_default=True, type=click.IntRange(min=2))
@click.option("--alpha", default="auto", show_default=True, help="'auto' (searched per group), 'off' (no smoothing) or a number in [0, 1].")
@click.option("--activation", type=click.Choice(["dynamic", "static"]), default="dynamic", show_default=True)
@click.option("--keep-float", multiple=True, help="Glob of linear layers to keep in float (repeatable), e.g. '*.down_proj'.")
@click.option("--keep-float-above", type=float, help="Also keep in float any layer whose relative error stays above this.")
@click.option(
    "--int8-lm-head",
    is_flag=True,
    help="Quantize the lm_head too (per-channel int8, no smoothing): fewer bytes per step, some fidelity lost (see `eval`).",
)
@click.option("--trust-remote-code", is_flag=True, help="Allow the checkpoint's own tokenizer code to run.")
@click.option(
    "--device",
    type=click.Choice(["cpu", "cuda", "npu"]),
    default="cpu",
    show_default=True,
    help="Where the forward passes, statistics and alpha search run; the artifact is written from the host.",
)
def calibrate(model_dir, output, trust_remote_code, device, **recipe_fields):
    """Calibrate MODEL_DIR (a local HF checkpoint) into a W8A8 artifact."""
    from ..calibration import CalibrationRecipe  # keeps --help torch-free
    from ..calibration import calibrate as run  # keeps --help torch-free

    recipe = CalibrationRecipe(**recipe_fields)
    artifact = run(model_dir, output=output, recipe=recipe, trust_remote_code=trust_remote_code, device=device)
    manifest = artifact.manifest
    click.echo(f"\n{'group':<32} {'alpha':>6} {'error before':>13} {'error after':>12}")
    for group in manifest["groups"]:
        alpha_text = "off" if group["alpha"] is None else f"{group['alpha']:.2f}"
        click.echo(f"{group['name']:<32} {alpha_text:>6} {group['error_before']:>13.3e} {group['error_after']:>12.3e}")
    kept = [name for name, layer in manifest["layers"].items() if not layer["quantized"]]
    floats = "+ embeddings; lm_head in W8A8" if "lm_head" in manifest["quantized_layers"] else "+ lm_head, embeddings"
    click.echo(f"\n{len(manifest['quantized_layers'])} linear layers in W8A8, {len(kept)} kept in float ({floats})")
    click.echo(f"wrote {artifact.path}")
