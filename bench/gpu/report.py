"""The engine benchmarks' result as lines of text."""

from __future__ import annotations

from typing import Any

from bench.gpu.prompt import prompt_lines


def table(result: dict[str, Any]) -> str:
    lines = [f"{result['model']} on {result['device']} (torch {result['torch']})"]
    t = result.get("ttft")
    if t:
        lines.append(
            f"ttft cold 8192: {t['cold_8192_ms']:.1f} ms; 8128 cached + 64 new: "
            f"{t['cached_8128_new_64_ms']:.1f} ms; 64 alone: {t['new_64_alone_ms']:.1f}"
            f" ms (ratio {t['cached_over_alone']:.2f}); that cached pass with 32 decodes: "
            f"{t['cached_64_with_32_decodes_ms']:.1f} ms"
        )
        if "new_64_alone_ms_piecewise" in t:
            lines.append(
                f"piecewise graphs: cold 8192: {t['cold_8192_ms_piecewise']:.1f} ms; 8128 "
                f"cached + 64 new: {t['cached_8128_new_64_ms_piecewise']:.1f} ms; 64 alone: "
                f"{t['new_64_alone_ms_piecewise']:.1f} ms (ratio "
                f"{t['cached_over_alone_piecewise']:.2f}); with 32 decodes: "
                f"{t['cached_64_with_32_decodes_ms_piecewise']:.1f} ms; first use (capture): "
                f"{t['new_64_first_use_ms_piecewise']:.0f} / "
                f"{t['cached_64_with_32_decodes_first_use_ms_piecewise']:.0f} / "
                f"{t['new_2000_first_use_ms_piecewise']:.0f} ms (buckets 64 / 128 / 2048)"
            )
    if result.get("prompt"):
        lines += prompt_lines(result["prompt"])
    for a in result.get("attention", []):
        variants = ", ".join(f"{k[6:-3]} {v:.3f}" for k, v in a.items()
                             if k.startswith("paged_"))
        lines.append(f"attention, one layer: {a['new']} new over {a['cached']} cached: "
                     f"paged {a['ms']:.3f} ms, gathered {a['gathered_ms']:.3f} ms"
                     + (f" (kernel variants q_warps_stages: {variants})" if variants else ""))
    pd = result.get("paged_decode")
    if pd:
        lines.append(f"decode attention, all layers ({pd['bytes_per_token']} bytes of K/V a "
                     f"token, copy bandwidth {pd['bandwidth_gb_s']:.0f} GB/s), ns per token of "
                     f"context:")
        for r in pd["shapes"]:
            lines.append(
                f"  batch {r['batch']} x {r['context']}: kernel {r['kernel_ns_per_token']:.2f} "
                f"({r['kernel_ms']:.3f} ms graphed, {r['kernel_eager_ms']:.3f} eager; "
                f"{r['kernel_over_floor']:.2f}x floor "
                f"{r['floor_ns_per_token']:.2f}), flex "
                f"{r.get('flex_ns_per_token', float('nan')):.2f}, gathered "
                f"{r.get('gathered_ns_per_token') or float('nan'):.2f}; whole step "
                f"{r['step_ms']:.2f} ms")
    mem = result.get("memory")
    if mem:
        lines.append("memory (GiB): " + ", ".join(
            f"{k} {v / 2**30:.2f}" for k, v in mem.items() if k != "iteration_context"))
    dc = result.get("decode_context")
    if dc:
        for r in dc["shapes"]:
            lines.append(f"decode attention, {dc['layers']} layers, batch {r['batch']} x "
                         f"{r['context']}: gathered {r['gathered_ms']:.2f} ms, in place "
                         f"{r['in_place_ms']:.2f} ms")
        paged = dc.get("paged_ns_per_token")
        lines.append(f"per token of context: gathered {dc['gathered_ns_per_token']:.1f} ns, "
                     f"in place {dc['in_place_ns_per_token']:.1f} ns"
                     + (f", paged {paged:.1f} ns" if paged is not None else ""))
    pc = result.get("prefill_context")
    if pc:
        for r in pc["shapes"]:
            lines.append(f"prefill attention, {pc['layers']} layers, {r['new']} new over "
                         f"{r['cached']} cached: {r['ms']:.3f} ms")
        if pc["per_cached_ms"] is not None:
            lines.append(
                f"a cached token adds {pc['per_cached_ms'] * 1e6:.1f} ns, a new x cached pair "
                f"{pc['per_token_cached_ms'] * 1e9:.1f} ps (calibration's fit: "
                f"{pc['calibration_per_cached_ms'] * 1e6:.1f} ns, "
                f"{pc['calibration_per_token_cached_ms'] * 1e9:.1f} ps)")
    for d in result.get("decode", []):
        lines.append(
            f"decode ({d['mode']}) batch {d['batch']}: {d['step_ms']:.2f} ms/step, "
            f"{d['tokens_per_s']:.0f} tokens/s"
        )
    for r in result.get("routing", {}).get("runs", []):
        lines.append(
            f"load {r['load']} {r['policy']:>11}: TTFT p50 {r['ttft_p50_ms']:.0f} ms "
            f"p99 {r['ttft_p99_ms']:.0f} ms, {r['tokens_per_s']:.0f} tokens/s, "
            f"hit {r['hit_rate']:.2f}"
        )
    return "\n".join(lines)
