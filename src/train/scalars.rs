//! The scalars of the log's events, by the tag under which TensorBoard (`Log`'s event file)
//! and Weights & Biases show them. `scripts/wandb_log.py` mirrors this mapping in Python:
//! a tag added here is added there, and tests/train_exporters.rs checks that the two agree.

use super::log::Event;

/// One value of a curve: `tag` (`section/name`) at training step `step`.
#[derive(Clone, Debug, PartialEq)]
pub struct Scalar {
    pub tag: String,
    pub step: u64,
    pub value: f64,
}

const GIB: f64 = (1u64 << 30) as f64;

/// The scalars of `event`: none for an event that holds no curve.
pub fn scalars(event: &Event) -> Vec<Scalar> {
    let at = |step: u64, values: &[(&str, f64)]| -> Vec<Scalar> {
        (values.iter())
            .map(|&(tag, value)| Scalar {
                tag: tag.to_string(),
                step,
                value,
            })
            .collect()
    };
    match event {
        Event::Step {
            step,
            loss,
            norm,
            lr,
            seconds,
            tokens_per_second,
            mfu,
            sol,
            ..
        } => {
            let mut values = vec![
                ("train/loss", *loss),
                ("train/grad_norm", *norm),
                ("train/lr", *lr),
                ("train/step_seconds", *seconds),
                ("train/tokens_per_second", *tokens_per_second),
            ];
            values.extend(mfu.map(|mfu| ("train/mfu", mfu)));
            values.extend(sol.map(|sol| ("train/sol", sol)));
            at(*step, &values)
        }
        Event::Eval {
            step, loss, full, ..
        } => {
            let tag = if *full { "eval/loss_full" } else { "eval/loss" };
            at(*step, &[(tag, *loss)])
        }
        // Known before the first step. A category may hold spaces ("host weights").
        Event::Memory { category, bytes } => {
            let tag = format!("memory/{}_gib", category.replace(' ', "_"));
            at(0, &[(tag.as_str(), *bytes as f64 / GIB)])
        }
        // A curve per figure, its lines the blocks and families: `update_ratio/layer_03`,
        // `update_ratio/qkv`.
        Event::Health { step, health } => {
            let all = &health.all;
            let mut values = vec![
                ("health/grad_norm".to_string(), all.grad_norm),
                (
                    "health/clipped_grad_norm".to_string(),
                    health.clipped_grad_norm,
                ),
                ("health/param_norm".to_string(), all.param_norm),
                ("health/update_ratio".to_string(), all.update_ratio),
            ];
            let layers =
                (health.layers.iter().enumerate()).map(|(l, n)| (format!("layer_{l:02}"), n));
            for (name, n) in layers.chain(health.families.iter().map(|(f, n)| (f.clone(), n))) {
                values.extend([
                    (format!("grad_norm/{name}"), n.grad_norm),
                    (format!("param_norm/{name}"), n.param_norm),
                    (format!("update_ratio/{name}"), n.update_ratio),
                ]);
            }
            let values: Vec<(&str, f64)> = values.iter().map(|(t, v)| (t.as_str(), *v)).collect();
            at(*step, &values)
        }
        Event::Skipped { step, .. } => at(*step, &[("train/skipped", 1.0)]),
        // What NVML did not give is left out.
        Event::GpuUtil { step, gpus } => {
            let mut values = vec![];
            for g in gpus {
                let readings = [
                    ("utilization", g.utilization.map(f64::from)),
                    ("sm_clock_mhz", g.sm_clock_mhz.map(f64::from)),
                    ("power_watts", g.power_watts),
                    ("temperature_c", g.temperature_c.map(f64::from)),
                    ("memory_used_gib", g.memory_used.map(|b| b as f64 / GIB)),
                ];
                let tag = |name: &str| format!("gpu/{}/{name}", g.gpu);
                values.extend(readings.iter().filter_map(|(n, v)| Some((tag(n), (*v)?))));
            }
            let values: Vec<(&str, f64)> = values.iter().map(|(t, v)| (t.as_str(), *v)).collect();
            at(*step, &values)
        }
        Event::Spike { step, zscore, .. } => at(*step, &[("train/spike_zscore", *zscore)]),
        _ => vec![],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tags(event: &Event) -> Vec<(String, u64)> {
        scalars(event)
            .into_iter()
            .map(|s| (s.tag, s.step))
            .collect()
    }

    #[test]
    fn a_step_has_mfu_only_where_the_device_has_a_peak() {
        let step = |mfu| Event::Step {
            step: 7,
            loss: 2.5,
            norm: 1.0,
            lr: 1e-3,
            tokens: 64,
            seconds: 0.5,
            tokens_per_second: 128.0,
            mfu,
            sol: None,
            data: String::new(),
        };
        let cpu = tags(&step(None));
        assert_eq!(cpu.len(), 5);
        assert!(
            cpu.iter()
                .all(|(tag, s)| tag.starts_with("train/") && *s == 7)
        );
        let gpu = scalars(&step(Some(0.4)));
        assert_eq!(gpu.len(), 6);
        assert_eq!(gpu[0].value, 2.5);
        assert_eq!(
            gpu.last(),
            Some(&Scalar {
                tag: "train/mfu".into(),
                step: 7,
                value: 0.4
            })
        );
    }

    #[test]
    fn memory_is_in_gib_at_step_0_and_evals_by_kind() {
        let memory = Event::Memory {
            category: "host weights".into(),
            bytes: 3 << 29,
        };
        assert_eq!(
            scalars(&memory),
            [Scalar {
                tag: "memory/host_weights_gib".into(),
                step: 0,
                value: 1.5
            }]
        );
        let eval = |full| Event::Eval {
            step: 4,
            loss: 1.0,
            tokens: 10,
            full,
        };
        assert_eq!(tags(&eval(false)), [("eval/loss".into(), 4)]);
        assert_eq!(tags(&eval(true)), [("eval/loss_full".into(), 4)]);
        let warning = Event::Warning {
            message: "w".into(),
        };
        assert!(scalars(&warning).is_empty());
    }
}
