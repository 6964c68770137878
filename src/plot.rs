//! Training logs (JSON Lines from `smelt train --log-file`) drawn as a PNG of four panels:
//! training and eval loss, learning rate, gradient norm, and throughput, each against the
//! step. Several logs are overlaid, one colour per run, to compare runs (bf16 against FP8,
//! say). Text is drawn with DejaVu Sans, embedded in the binary, so plotting needs no system
//! fonts.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::Once;

use anyhow::{Context, Result, anyhow, bail};
use plotters::prelude::*;

use crate::io::atomic::write_atomically;
use crate::train::log::{self, Event};

/// Each plotted quantity by step, from the last run in a log.
#[derive(Default, Debug)]
pub struct Series {
    pub loss: BTreeMap<u64, f64>,
    pub eval: BTreeMap<u64, f64>,
    pub lr: BTreeMap<u64, f64>,
    pub norm: BTreeMap<u64, f64>,
    pub tokens_per_second: BTreeMap<u64, f64>,
}

impl Series {
    /// A log may hold several runs appended one after another. A run that continued from a
    /// checkpoint replaces what followed that checkpoint; a fresh run replaces everything.
    pub fn from_events(events: &[Event]) -> Series {
        let mut s = Series::default();
        // Set by a run's options; cleared by its first step unless it continues.
        let mut fresh_run = false;
        for e in events {
            match e {
                Event::Option { .. } => fresh_run = true,
                Event::Checkpoint {
                    step, loaded: true, ..
                } => {
                    fresh_run = false;
                    s.for_each(|m| {
                        m.split_off(&(step + 1));
                    });
                }
                Event::Step { .. } | Event::Eval { .. } if fresh_run => {
                    fresh_run = false;
                    s = Series::default();
                }
                _ => {}
            }
            match *e {
                Event::Step {
                    step,
                    loss,
                    norm,
                    lr,
                    tokens_per_second,
                    ..
                } => {
                    s.loss.insert(step, loss);
                    s.norm.insert(step, norm);
                    s.lr.insert(step, lr);
                    s.tokens_per_second.insert(step, tokens_per_second);
                }
                Event::Eval { step, loss, .. } => {
                    s.eval.insert(step, loss);
                }
                _ => {}
            }
        }
        s
    }

    fn for_each(&mut self, mut f: impl FnMut(&mut BTreeMap<u64, f64>)) {
        for m in [
            &mut self.loss,
            &mut self.eval,
            &mut self.lr,
            &mut self.norm,
            &mut self.tokens_per_second,
        ] {
            f(m);
        }
    }
}

/// The last run of the log at `path`, which must have trained at least one step.
pub fn read_series(path: &Path) -> Result<Series> {
    let contents = log::read(path)?;
    if !contents.skipped.is_empty() {
        eprintln!(
            "warning: {}: skipped lines {:?}, which are not log events (cut short by a crash?)",
            path.display(),
            contents.skipped
        );
    }
    let series = Series::from_events(&contents.events);
    if series.loss.is_empty() {
        bail!("{}: the log has no training steps to plot", path.display());
    }
    Ok(series)
}

/// A run's name in the legend: its log's file name without the extension.
pub fn label(path: &Path) -> String {
    path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into(),
    )
}

/// Registers the embedded font as plotters' "sans-serif", once per process.
fn register_font() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        result = plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            dejavu::sans::regular(),
        )
        .map_err(|_| anyhow!("the embedded DejaVu Sans font did not load"));
    });
    result
}

/// One colour per run, in order.
const PALETTE: [RGBColor; 6] = [
    BLUE,
    RED,
    RGBColor(0, 150, 0),
    MAGENTA,
    RGBColor(230, 140, 0),
    BLACK,
];

/// One line of a panel: its legend, points, colour and stroke width.
type Line<'a> = (String, &'a BTreeMap<u64, f64>, RGBColor, u32);

/// Draws the four panels into an RGB buffer, each run in its colour. With one run, the
/// training and eval losses get two colours; with several, eval losses are the thick lines.
pub fn render(runs: &[(String, Series)], width: u32, height: u32) -> Result<Vec<u8>> {
    register_font()?;
    let mut rgb = vec![0u8; width as usize * height as usize * 3];
    {
        let root = BitMapBackend::with_buffer(&mut rgb, (width, height)).into_drawing_area();
        root.fill(&WHITE).map_err(draw_error)?;
        let panels = root.split_evenly((2, 2));
        let keys = runs.iter().flat_map(|(_, s)| s.loss.keys().copied());
        let (first, last) = (keys.clone().min(), keys.max());
        let (first, last) = first.zip(last).expect("every run has steps");
        let steps = first.saturating_sub(1)..last.max(first + 1);
        let single = runs.len() == 1;
        let colour = |i: usize| PALETTE[i % PALETTE.len()];
        let named = |run: &str, what: &str| {
            if single {
                what.to_string()
            } else {
                format!("{run} {what}")
            }
        };
        let mut loss: Vec<Line> = vec![];
        for (i, (run, s)) in runs.iter().enumerate() {
            let eval_colour = if single { RED } else { colour(i) };
            loss.push((
                named(run, "train loss"),
                &s.loss,
                colour(i),
                1 + single as u32,
            ));
            loss.push((named(run, "eval loss"), &s.eval, eval_colour, 3));
        }
        panel(&panels[0], "loss", steps.clone(), &loss)?;
        let one_each = |what: &str, pick: fn(&Series) -> &BTreeMap<u64, f64>, c: RGBColor| {
            runs.iter()
                .enumerate()
                .map(|(i, (run, s))| {
                    let c = if single { c } else { colour(i) };
                    (named(run, what), pick(s), c, 2)
                })
                .collect::<Vec<Line>>()
        };
        let lr = one_each("lr", |s| &s.lr, RGBColor(0, 150, 0));
        panel(&panels[1], "learning rate", steps.clone(), &lr)?;
        let norm = one_each("grad norm", |s| &s.norm, MAGENTA);
        let title = "gradient norm (before clipping)";
        panel(&panels[2], title, steps.clone(), &norm)?;
        let tps = one_each("tok/s", |s| &s.tokens_per_second, BLACK);
        panel(&panels[3], "throughput (tokens/s)", steps, &tps)?;
        root.present().map_err(draw_error)?;
    }
    Ok(rgb)
}

fn draw_error<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("drawing the plot: {e:?}")
}

/// One chart of `lines` against the step, the y range fitted to their values.
fn panel(
    area: &DrawingArea<BitMapBackend, plotters::coord::Shift>, title: &str,
    steps: std::ops::Range<u64>, lines: &[Line],
) -> Result<()> {
    let values = lines.iter().flat_map(|(_, m, _, _)| m.values().copied());
    let (lo, hi) = values
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), v| {
            (lo.min(v), hi.max(v))
        });
    let (lo, hi) = if lo <= hi { (lo, hi) } else { (0.0, 1.0) };
    let pad = ((hi - lo) * 0.05).max(hi.abs() * 1e-3).max(1e-12);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(70)
        .build_cartesian_2d(steps, (lo - pad)..(hi + pad))
        .map_err(draw_error)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_label_formatter(&|y| tick(*y))
        .draw()
        .map_err(draw_error)?;
    for (name, points, color, width) in lines.iter().filter(|l| !l.1.is_empty()) {
        let (color, width) = (*color, *width);
        let xy: Vec<(u64, f64)> = points.iter().map(|(&x, &y)| (x, y)).collect();
        // Segment by segment: plotters joins the segments of a wide polyline with unbounded
        // miters, which at sharp turns (a spike between neighbouring steps) shoot out of the
        // panel and leave gaps in the line.
        let segments = xy
            .windows(2)
            .map(|pair| PathElement::new(pair.to_vec(), color.stroke_width(width)));
        chart
            .draw_series(segments)
            .map_err(draw_error)?
            .label(name.as_str())
            .legend(move |(x, y)| {
                PathElement::new([(x, y), (x + 20, y)], color.stroke_width(width))
            });
        if points.len() < 50 {
            // Sparse series (evals) get markers, so that single points show.
            chart
                .draw_series(
                    points
                        .iter()
                        .map(|(&x, &y)| Circle::new((x, y), 4, color.filled())),
                )
                .map_err(draw_error)?;
        }
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(draw_error)?;
    Ok(())
}

/// An axis label: plain decimals for ordinary magnitudes, scientific notation otherwise.
fn tick(y: f64) -> String {
    let a = y.abs();
    if a == 0.0 {
        "0".into()
    } else if !(1e-2..1e5).contains(&a) {
        format!("{y:.2e}")
    } else {
        let s = format!("{y:.3}");
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    }
}

/// Encodes an RGB buffer as a PNG, written atomically.
pub fn write_png(path: &Path, rgb: &[u8], width: u32, height: u32) -> Result<()> {
    write_atomically(path, |tmp| {
        let file = std::fs::File::create(tmp)?;
        let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), width, height);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header()?;
        writer.write_image_data(rgb)?;
        writer.finish()?;
        Ok(())
    })
    .with_context(|| {
        format!(
            "-o {}: cannot write the PNG; choose a writable path",
            path.display()
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn option() -> Event {
        Event::Option {
            name: "lr".into(),
            value: serde_json::json!(1e-3),
        }
    }

    fn step(step: u64, loss: f64) -> Event {
        Event::Step {
            step,
            loss,
            norm: 1.0,
            lr: 1e-3,
            tokens: 8,
            seconds: 0.1,
            tokens_per_second: 80.0,
            mfu: None,
            sol: None,
            data: String::new(),
        }
    }

    #[test]
    fn a_continued_run_replaces_what_followed_its_checkpoint() {
        let loaded = Event::Checkpoint {
            step: 2,
            path: "ckpt/step-00000002".into(),
            loaded: true,
        };
        let events = [
            option(),
            step(1, 5.0),
            step(2, 4.0),
            step(3, 3.5), // lost: the run died before checkpointing it
            option(),
            loaded,
            step(3, 3.0),
            step(4, 2.0),
        ];
        let s = Series::from_events(&events);
        let losses: Vec<(u64, f64)> = s.loss.into_iter().collect();
        assert_eq!(losses, [(1, 5.0), (2, 4.0), (3, 3.0), (4, 2.0)]);
        // A fresh run appended to the same log starts the plot over.
        let mut more = events.to_vec();
        more.extend([option(), step(1, 6.0)]);
        let s = Series::from_events(&more);
        assert_eq!(s.loss.into_iter().collect::<Vec<_>>(), [(1, 6.0)]);
    }

    #[test]
    fn sharp_turns_stay_inside_their_panel() {
        // One run's gradient norm (magenta, bottom-left panel) over 1,000 steps, under a
        // pixel apart, starting with the jumps of a real run's first 25 steps. No magenta
        // pixel may land in the top half.
        let start = [
            24.8, 21.9, 23.8, 16.1, 8.4, 5.4, 5.0, 4.0, 4.9, 4.5, 3.6, 6.0, 4.2, 2.9, 3.5, 2.4,
            21.1, 28.6, 3.3, 2.2, 4.3, 2.0, 2.1, 1.8, 2.1,
        ];
        let s = Series {
            loss: (1..=1000).map(|i| (i, 5.0 - i as f64 * 1e-3)).collect(),
            norm: (1..=1000)
                .map(|i| (i, start.get(i as usize - 1).copied().unwrap_or(1.0)))
                .collect(),
            ..Series::default()
        };
        let (width, height) = (1400, 900);
        let rgb = render(&[("run".into(), s)], width, height).unwrap();
        let magenta = |p: &[u8]| p[0] > 200 && p[1] < 60 && p[2] > 200;
        let (top, bottom) = rgb.split_at((width * height / 2 * 3) as usize);
        let stray = top.chunks(3).filter(|p| magenta(p)).count();
        assert_eq!(
            stray, 0,
            "{stray} magenta pixels above the gradient-norm panel"
        );
        assert!(
            bottom.chunks(3).any(magenta),
            "the gradient norm was not drawn"
        );
    }
}
