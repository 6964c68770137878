//! What the readers hand to the tokenizer: whole documents, in input order.

use anyhow::Result;

/// A document's text in pieces, each trained or not: a plain document is one trained piece,
/// a prompt and response an untrained and a trained one, a conversation the pieces its chat
/// template cuts it into.
pub struct Document {
    pub pieces: Vec<Piece>,
    /// Whether the tokenizer adds its special tokens (such as a BOS) before the first piece:
    /// a chat template writes its own.
    pub special_tokens: bool,
    /// Whether the EOS that follows the document is trained: after a response, the model
    /// learns to stop; a conversation's template writes the end of each turn itself.
    pub eos_trained: bool,
}

#[derive(Debug)]
pub struct Piece {
    pub text: String,
    pub trained: bool,
}

impl Document {
    pub fn text(text: String) -> Document {
        Document {
            pieces: vec![Piece {
                text,
                trained: true,
            }],
            special_tokens: true,
            eos_trained: true,
        }
    }

    /// Chat/SFT data: the prompt, not trained, then the response.
    pub fn prompt_response(prompt: String, response: String) -> Document {
        Document {
            pieces: vec![
                Piece {
                    text: prompt,
                    trained: false,
                },
                Piece {
                    text: response,
                    trained: true,
                },
            ],
            special_tokens: true,
            eos_trained: true,
        }
    }

    /// A conversation rendered by its chat template.
    pub fn conversation(pieces: Vec<Piece>) -> Document {
        Document {
            pieces,
            special_tokens: false,
            eos_trained: false,
        }
    }

    pub fn is_empty(&self) -> bool {
        self.pieces.iter().all(|p| p.text.is_empty())
    }

    pub fn bytes(&self) -> usize {
        self.pieces.iter().map(|p| p.text.len()).sum()
    }
}

/// Where a reader sends each document, with how many bytes of its file it has read so far
/// (for the progress bar). An error from the sink stops the reader.
pub type Sink<'a> = dyn FnMut(Document, u64) -> Result<()> + 'a;
