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
    pub fn add(&mut self, op: &str, seconds: f64) {
        match self.entries.iter_mut().find(|e| e.op == op) {
            Some(e) => {
                e.calls += 1;
                e.seconds += seconds;
            }
            None => self.entries.push(OpTime {
                op: op.to_string(),
                calls: 1,
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
}
