//! What `smelt tokenize` prints at the end.

use std::fmt;

use indicatif::HumanCount;

use super::eos::Eos;
use super::outputs::Written;

pub struct Summary {
    pub input_files: usize,
    pub input_bytes: u64,
    /// Documents tokenized, and empty ones left out.
    pub documents: usize,
    pub empty: usize,
    /// Tokens written, one EOS per document included.
    pub tokens: usize,
    /// With a loss mask (chat data): the tokens it trains.
    pub trained: Option<usize>,
    pub seconds: f64,
    pub vocab_size: usize,
    pub eos: Eos,
    pub files: Vec<Written>,
}

impl fmt::Display for Summary {
    fn fmt(&self, f: &mut fmt::Formatter) -> fmt::Result {
        writeln!(
            f,
            "tokenized {} documents from {} ({:.1} MB) in {:.1} s ({:.2} MB/s)",
            HumanCount(self.documents as u64),
            match self.input_files {
                1 => "1 file".to_string(),
                n => format!("{n} files"),
            },
            self.input_bytes as f64 / 1e6,
            self.seconds,
            self.input_bytes as f64 / 1e6 / self.seconds.max(1e-9)
        )?;
        writeln!(
            f,
            "{} tokens, {:.1} per document, EOS {} {:?} (from {}), vocabulary {}",
            HumanCount(self.tokens as u64),
            self.tokens as f64 / self.documents.max(1) as f64,
            self.eos.id,
            self.eos.token,
            self.eos.source,
            self.vocab_size
        )?;
        if let Some(trained) = self.trained {
            writeln!(
                f,
                "the loss mask trains {} of them ({:.1}%)",
                HumanCount(trained as u64),
                100.0 * trained as f64 / self.tokens.max(1) as f64
            )?;
        }
        if self.empty > 0 {
            writeln!(
                f,
                "left out {} empty documents",
                HumanCount(self.empty as u64)
            )?;
        }
        let width = self
            .files
            .iter()
            .map(|w| w.path.display().to_string().len())
            .max()
            .unwrap_or(0);
        for w in &self.files {
            writeln!(
                f,
                "  {:width$}  {:>13} tokens  {:>9} documents",
                w.path.display().to_string(),
                HumanCount(w.tokens as u64).to_string(),
                HumanCount(w.documents as u64).to_string()
            )?;
        }
        Ok(())
    }
}
