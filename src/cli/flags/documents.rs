//! The flags that keep the documents packed into a sequence apart, shared by `smelt train`
//! and `smelt bench` (`model::documents`).

use clap::Args;

use crate::model::Documents;

#[derive(Args, Debug, Clone, Copy)]
pub struct DocumentFlags {
    /// Keep the documents packed into each sequence apart in attention: a token sees only
    /// the tokens of its own document, which runs up to and including the EOS that ends it.
    /// Attention skips the blocks of scores between documents, so short documents make the
    /// step faster.
    #[arg(long, help_heading = "Model and data")]
    doc_mask: bool,
    /// Count each token's RoPE position from the start of its document, as if each document
    /// began a sequence.
    #[arg(long, help_heading = "Model and data")]
    doc_positions: bool,
}

impl DocumentFlags {
    /// Whether either flag is given.
    pub fn any(&self) -> bool {
        self.doc_mask || self.doc_positions
    }

    /// What the flags ask for, with documents ended by `eos`; `None` where neither is given.
    pub fn documents(&self, eos: i32) -> Option<Documents> {
        self.any().then_some(Documents {
            eos,
            mask: self.doc_mask,
            positions: self.doc_positions,
        })
    }
}
