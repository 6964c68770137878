//! `smelt train --opt-m-dtype q8 --opt-v-dtype q8` end to end on the CPU: 8-bit Adam moments
//! learn as f32 ones do in about a quarter of their memory, which the memory table and
//! `smelt plan` both count, and the flags are checked. (Their resume is in
//! `tests/train_resume.rs`, their update against bitsandbytes' in `tests/adam8bit.rs`.)

mod train_support;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use smelt::train::log::Event;
use train_support::*;

const Q8: [&str; 4] = ["--opt-m-dtype", "q8", "--opt-v-dtype", "q8"];

/// The tiny model at hidden 64, whose matrices all have at least the 4,096 elements that
/// 8-bit moments need, while its norms keep f32 moments.
fn model_dir(set: &Setup) -> PathBuf {
    model_variant(set, "model", |c| {
        c["hidden_size"] = 64.into();
        c["intermediate_size"] = 192.into();
    })
}

/// The device memory categories a run's log lists, with their bytes.
fn memory(log: &Path) -> BTreeMap<String, u64> {
    (events(log).into_iter())
        .filter_map(|e| match e {
            Event::Memory { category, bytes } => Some((category, bytes)),
            _ => None,
        })
        .collect()
}

#[test]
fn eight_bit_moments_learn_as_f32_ones_in_a_quarter_of_the_memory() {
    let set = setup();
    let root = &set.root;
    let model = model_dir(&set);
    let train = |name: &str, flags: &[&str]| {
        smelt_ok(&strs(&model_run_args(root, &model, name, flags)));
        root.join(format!("{name}.jsonl"))
    };
    let (f32_log, q8_log) = (train("f32", &[]), train("q8", &Q8));
    let (_, f32_last) = first_and_last_losses(&f32_log);
    let (first, last) = first_and_last_losses(&q8_log);
    println!("f32 moments -> {f32_last:.4}; q8 {first:.4} -> {last:.4}");
    assert!(last < 0.8 * first, "q8 loss {first} -> {last} did not fall");
    // Broken moments (a wrong scale, a wrong map) stall or diverge; 3% leaves room for the
    // quantization noise of a 40-step run.
    assert!(
        (last - f32_last).abs() < 0.03 * f32_last,
        "q8 ends at {last}, f32 moments at {f32_last}"
    );

    let (f32_mem, q8_mem) = (memory(&f32_log), memory(&q8_log));
    let moments = |m: &BTreeMap<String, u64>| {
        ["adam_m", "adam_v", "adam_m_absmax", "adam_v_absmax"]
            .iter()
            .map(|c| m.get(*c).copied().unwrap_or(0))
            .sum::<u64>()
    };
    let ratio = moments(&q8_mem) as f64 / moments(&f32_mem) as f64;
    println!(
        "moments: {} bytes in f32, {} in q8 ({ratio:.3})",
        moments(&f32_mem),
        moments(&q8_mem)
    );
    // A byte per element and 4 bytes per 256 where quantized, 4 bytes per element in the
    // norms (0.2% of the parameters).
    assert!(
        ratio > 0.25 && ratio < 0.26,
        "q8 moments take {ratio} of f32's"
    );
    assert!(q8_mem["adam_m_absmax"] > 0 && !f32_mem.contains_key("adam_m_absmax"));

    // `smelt plan` counts what the run allocated.
    let mut plan = vec!["plan", "--device", "cpu", "--device-memory", "80", "--json"];
    plan.extend(["--batch-size", "4", "--seq-len", "32", "--model", s(&model)]);
    plan.extend(Q8);
    let planned: serde_json::Value = serde_json::from_str(&smelt_ok(&plan)).unwrap();
    let row = &planned["plans"][0]["rows"][0]["device"];
    for category in ["adam_m", "adam_v", "adam_m_absmax", "adam_v_absmax"] {
        assert_eq!(
            row[category].as_u64(),
            Some(q8_mem[category]),
            "{category}: planned {row}"
        );
    }
}

#[test]
fn eight_bit_moments_come_in_pairs() {
    let dir = tempfile::tempdir().unwrap();
    for flags in [["--opt-m-dtype", "q8"], ["--opt-v-dtype", "q8"]] {
        let args = tiny_run_args(dir.path(), "refused", &flags);
        let err = smelt_err(&strs(&args));
        assert!(
            err.contains("give q8 to both flags, or to neither"),
            "{flags:?}: {err}"
        );
    }
}
