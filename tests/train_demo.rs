//! The demo configuration, shortened, trains and its loss falls; and
//! `smelt plot` draws a valid PNG from the log that run wrote.

mod train_support;

use smelt::train::log::Event;
use train_support::*;

#[test]
fn shortened_demo_trains_and_its_log_plots() {
    let dir = tempfile::tempdir().unwrap();
    let demo = dir.path().join("demo");
    // The demo's model, data and settings, with fewer and smaller steps.
    let stdout = smelt_ok(&[
        "train",
        "--demo-dir",
        s(&demo),
        "--steps",
        "60",
        "--batch-size",
        "8",
        "--eval-every-n-steps",
        "20",
    ]);
    assert!(stdout.contains("[T] step 60/60"), "{stdout}");
    assert!(stdout.contains("sample (temperature"), "{stdout}");

    let log_path = demo.join("log.jsonl");
    let steps = steps(&log_path);
    assert_eq!(steps.len(), 60);
    let first = steps[0].1;
    // An untrained byte model starts near ln 256 ≈ 5.55 nats.
    assert!((first - 256f64.ln()).abs() < 0.3, "first loss {first}");
    let evals: Vec<(u64, f64, bool)> = events(&log_path)
        .into_iter()
        .filter_map(|e| match e {
            Event::Eval {
                step, loss, full, ..
            } => Some((step, loss, full)),
            _ => None,
        })
        .collect();
    assert_eq!(
        evals.iter().map(|e| (e.0, e.2)).collect::<Vec<_>>(),
        [(20, false), (40, false), (60, true)]
    );
    // 60 steps reach about 2.4 (−57%); the full 250-step demo must reach −40%. Asking −35%
    // here leaves room for the corpus (the repository's sources) to change.
    let last = evals[2].1;
    assert!(
        last < 0.65 * first,
        "eval loss {last} vs first step {first}"
    );
    assert!(evals[0].1 > evals[2].1, "eval loss did not fall: {evals:?}");
    for file in ["config.json", "model.safetensors"] {
        assert!(demo.join("model").join(file).is_file(), "{file} missing");
    }

    // `smelt plot` on that log.
    let png_path = dir.path().join("train.png");
    smelt_ok(&["plot", s(&log_path), "-o", s(&png_path)]);
    let bytes = std::fs::read(&png_path).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    let decoder = png::Decoder::new(std::io::Cursor::new(bytes));
    let mut reader = decoder.read_info().unwrap();
    let mut pixels = vec![0; reader.output_buffer_size()];
    let info = reader.next_frame(&mut pixels).unwrap();
    assert_eq!((info.width, info.height), (1400, 900));
    // Each of the four panels has drawn something besides the white background, in colour.
    let (w, h) = (info.width as usize, info.height as usize);
    for (px, py) in [(0, 0), (1, 0), (0, 1), (1, 1)] {
        let drawn = (py * h / 2..(py + 1) * h / 2)
            .flat_map(|y| (px * w / 2..(px + 1) * w / 2).map(move |x| (x, y)))
            .filter(|&(x, y)| {
                let p = &pixels[3 * (y * w + x)..3 * (y * w + x) + 3];
                p != [255, 255, 255]
            })
            .count();
        assert!(drawn > 2000, "panel ({px}, {py}) has {drawn} drawn pixels");
    }

    // Run again, the demo replaces its own model; its warmup of 20 steps is shortened to a
    // 1-step run, with a warning.
    let model = std::fs::read(demo.join("model/model.safetensors")).unwrap();
    let again = smelt_ok(&["train", "--demo-dir", s(&demo), "--steps", "1"]);
    assert!(
        again.contains("warning: --warmup 20 is longer than the run's 1 steps"),
        "{again}"
    );
    assert_ne!(
        std::fs::read(demo.join("model/model.safetensors")).unwrap(),
        model
    );
}

#[test]
fn plot_refuses_a_file_that_is_not_a_log() {
    let dir = tempfile::tempdir().unwrap();
    let bogus = dir.path().join("notes.txt");
    std::fs::write(&bogus, "hello\n").unwrap();
    let err = smelt_err(&["plot", s(&bogus), "-o", s(&dir.path().join("x.png"))]);
    assert!(
        err.contains("notes.txt: no training events") && err.contains("--log-file"),
        "{err}"
    );
    assert!(!dir.path().join("x.png").exists());
}
