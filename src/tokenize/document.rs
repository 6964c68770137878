//! What the readers hand to the tokenizer: whole documents, in input order.

use anyhow::Result;

pub struct Document {
    /// Chat/SFT data: the prompt, which comes first and is not trained.
    pub prompt: Option<String>,
    /// The text to train on.
    pub text: String,
}

impl Document {
    pub fn text(text: String) -> Document {
        Document { prompt: None, text }
    }

    pub fn is_empty(&self) -> bool {
        self.text.is_empty() && self.prompt.as_ref().is_none_or(|p| p.is_empty())
    }

    pub fn bytes(&self) -> usize {
        self.text.len() + self.prompt.as_ref().map_or(0, |p| p.len())
    }
}

/// Where a reader sends each document, with how many bytes of its file it has read so far
/// (for the progress bar). An error from the sink stops the reader.
pub type Sink<'a> = dyn FnMut(Document, u64) -> Result<()> + 'a;
