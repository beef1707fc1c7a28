"""The figures Lab 03's report shows (experiments/28-qlora-preview/REPORT.template.md), from its results.json.

``report_values`` is a pure function of the results the lab measured and the planner computed: table rows,
verdicts and derived sizes, keyed by the names the template uses. The lab fills the template with them.
"""
from __future__ import annotations

from .memory.fresh_run import comparison, comparison_table, mib
from .qlora_checks import sensitivity

GiB = 1024**3


def report_values(r: dict, memory_rows: dict[str, str]) -> dict:
    """The template's values from Lab 03's results (`memory_rows`: block D's row name -> label)."""
    a, b, c, d, e = r["A"], r["B"], r["C"], r["D"], r["E"]
    nf4, bnb, p7 = b["schemes"][-1], b["bitsandbytes_max_abs_diff"], d["planner_7b"]
    m = comparison(d["rows"], d["planner"], d["lora_params"], d["lora_tensors"])
    tot, planner_mini = m["total"], m["planned"]
    return dict(
        r=r, a=a, b=b, c=c, d=d, e=e, nf4=nf4, int8=b["schemes"][0], n_q=a["quantized_layers"], fence="```",
        base_sha16=r["base_sha256"][:16], lab02_sha16=r["lab02_adapter_sha256"][:16],
        buffers=", ".join(f"`{n}` {s} {t}" for n, (s, t) in a["q_proj_buffers"].items()),
        packed_count=a["summary"]["quantized"] // 2,
        scheme_rows="\n".join(
            f"| {s['scheme']} | {s['weight_error']:.2%} | {s['base_only']['ratio']:.2%} | {s['with_adapter']['ratio']:.2%} "
            f"| {s['with_adapter']['mean_abs_diff']:.4f} | {s['with_adapter']['max_abs_diff']:.3f} "
            f"| {s['with_adapter']['top1_agreement']:.1%} | {s['val_loss']:.4f} |" for s in b["schemes"]),
        verdict=(f"**{b['ratio']:.2%} is within the {b['tolerance']:.0%} tolerance.**" if b["within_tolerance"] else
                 f"**{b['ratio']:.2%} is above the {b['tolerance']:.0%} tolerance** the seed expects; the check fails, "
                 "and the measurements say why:"),
        bnb=("not measured (bitsandbytes is not installed)" if bnb is None else f"max |logit difference| {bnb:.1e}"),
        **sensitivity(b["single_linear"]),
        cb=c["bf16"], bf16_falls=c["bf16"]["all_finite"] and c["bf16"]["last_mean"] < c["bf16"]["first_mean"],
        cs=c["finetune_manifest"]["config"], vals=", ".join(f"{v:.4f} (step {s})" for s, v in c["val"]),
        loss_down=c["val_loss_after"] < nf4["val_loss"] and c["last_mean"] < c["first_mean"],
        ending="ending below" if c["val_loss_after"] < b["fp_val_loss"] else "ending above",
        memory_table=comparison_table(d["rows"], d["planner"], memory_rows), tot=tot, planner_mini=planner_mini,
        lora_extra=m["lora_extra"], steps_extra=m["steps_extra"], extra_total=m["extra_total"],
        agree=("The frozen base matches the planner byte for byte in both rows." if m["exact"] else
               "**The measured bytes do not match the planner plus the differences below: a bug to look into.**"),
        rss_lora_mib=mib(m["rss"]["lora-fp16"]), rss_qlora_mib=mib(m["rss"]["qlora-nf4"]),
        saving_mini=tot["lora-fp16"] - tot["qlora-nf4"], saving_mini_mib=mib(tot["lora-fp16"] - tot["qlora-nf4"]),
        fp32_lora_mib=mib(d["fp32_lora_weights"]),
        planner_saving_mib=mib(planner_mini["lora-fp16"] - planner_mini["qlora-nf4"]),
        saving_7b_gib=(p7["lora-fp16"]["total"] - p7["qlora-nf4"]["total"]) / GiB,
        p7_lora_gib=p7["lora-fp16"]["total"] / GiB, p7_qlora_gib=p7["qlora-nf4"]["total"] / GiB,
        e_rows="\n".join(f"| `{n}` | {o['finite']} | {o['val_loss']:.4f} |" for n, o in e["adapters"].items()),
        all_finite=all(o["finite"] for o in e["adapters"].values()),
        busy=(f" (above {r['cpus']}: other jobs shared the CPUs, and every time in this report stretched with them)"
              if max(r["load_average_start"], r["load_average_end"]) > r["cpus"] else ""),
    )


def manifest_fields(r: dict, settings: dict) -> tuple[dict, dict]:
    """Lab 03's manifest.json: its config (`settings`: the lab's LoRA, scheme, epochs and tolerance, plus what
    the run recorded) and the extra fields (lineage and the headline results)."""
    c, d = r["C"], r["D"]
    config = {"base": r["base"], "lab02_adapter": r["lab02_adapter"], **settings,
              "train": c["finetune_manifest"]["config"]["train"], "memory_batch": d["batch"], "memory_steps": d["steps"]}
    extra = {"init_adapter_sha256": r["lab02_adapter_sha256"], "finetune_manifest": c["finetune_manifest"],
             "results": {"B_ratio": r["B"]["ratio"], "B_within_tolerance": r["B"]["within_tolerance"],
                         "C_val_loss_after": c["val_loss_after"], "C_steps": c["steps"],
                         "D_total_bytes": {k: v["after_steps"]["total"] for k, v in d["rows"].items()}}}
    return config, extra


def summary_line(r: dict) -> str:
    """The one line Lab 03 prints at the end."""
    b, c = r["B"], r["C"]
    return (f"B: logit diff {b['ratio']:.2%} (tolerance {b['tolerance']:.0%}: "
            f"{'met' if b['within_tolerance'] else 'not met'}); C: val {b['schemes'][-1]['val_loss']:.4f} -> "
            f"{c['val_loss_after']:.4f} over {c['steps']} steps (bf16: {c['bf16']['val_loss_after']:.4f}, train loss "
            f"{c['bf16']['first_loss']:.4f} -> {c['bf16']['last_loss']:.4f})")
