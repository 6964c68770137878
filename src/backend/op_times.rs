//! Device time per backend op, for `smelt bench --op-times`: where the real step's time goes,
//! with warm caches and every kernel in its place, which a profiler that replays one kernel at
//! a time does not show.

/// One op's total over the steps timed. A matmul's name carries its shape (`M×N×K`), so the
/// projections of a layer and the LM head come out apart.
#[derive(Clone, Debug, PartialEq)]
pub struct OpTime {
    pub op: String,
    pub calls: usize,
    pub seconds: f64,
}

/// Totals by name, in order of first appearance.
#[derive(Default)]
pub struct OpTotals {
    entries: Vec<OpTime>,
}

impl OpTotals {
    /// One call of `op`.
    pub fn add(&mut self, op: &str, seconds: f64) {
        self.add_calls(op, 1, seconds);
    }

    pub fn add_calls(&mut self, op: &str, calls: usize, seconds: f64) {
        match self.entries.iter_mut().find(|e| e.op == op) {
            Some(e) => {
                e.calls += calls;
                e.seconds += seconds;
            }
            None => self.entries.push(OpTime {
                op: op.to_string(),
                calls,
                seconds,
            }),
        }
    }

    pub fn take(&mut self) -> Vec<OpTime> {
        std::mem::take(&mut self.entries)
    }
}

/// `matmul M×N×K`, the name a matmul's time is filed under.
pub fn matmul_name(m: usize, n: usize, k: usize) -> String {
    format!("matmul {m}×{n}×{k}")
}

/// `ops` summed by family, the first word of a name (`matmul` for every shape, `quantize`
/// for every FP8 quantization), largest first: the profile of a step at a glance.
pub fn by_family(ops: &[OpTime]) -> Vec<OpTime> {
    let mut totals = OpTotals::default();
    for o in ops {
        let family = o.op.split_whitespace().next().unwrap_or_default();
        totals.add_calls(family, o.calls, o.seconds);
    }
    let mut families = totals.take();
    families.sort_by(|a, b| b.seconds.total_cmp(&a.seconds));
    families
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_sum_by_name_in_first_seen_order() {
        let mut t = OpTotals::default();
        t.add("b", 1.0);
        t.add("a", 0.5);
        t.add("b", 2.0);
        let out = t.take();
        assert_eq!(
            out,
            vec![
                OpTime {
                    op: "b".into(),
                    calls: 2,
                    seconds: 3.0
                },
                OpTime {
                    op: "a".into(),
                    calls: 1,
                    seconds: 0.5
                },
            ]
        );
        assert!(t.take().is_empty(), "take empties the totals");
    }

    #[test]
    fn families_sum_every_shape_and_come_largest_first() {
        let op = |op: &str, calls, seconds| OpTime {
            op: op.into(),
            calls,
            seconds,
        };
        let ops = [
            op("rmsnorm_forward", 24, 4.0),
            op(&matmul_name(8, 4, 2), 48, 3.0),
            op("quantize 8×4 rows", 24, 1.0),
            op(&matmul_name(8, 2, 4), 24, 2.0),
            op("quantize 4×8 rows+cols", 24, 0.5),
        ];
        assert_eq!(
            by_family(&ops),
            vec![
                op("matmul", 72, 5.0),
                op("rmsnorm_forward", 24, 4.0),
                op("quantize", 48, 1.5),
            ]
        );
    }
}
