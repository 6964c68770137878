//! Prints a sample's text as its tokens come, the way a reader expects generation to look.
//!
//! A token's text is not always known alone: it may end inside a UTF-8 character (decoded as
//! U+FFFD until the rest arrives), and SentencePiece decoders drop the space that starts a
//! decoded sequence. So the stream decodes a window of the newest tokens together with the
//! token before it, drops that token's own text, holds back a trailing U+FFFD, and prints
//! what it has not printed yet. The window restarts after each complete line, so that a long
//! sample costs a line's decoding a token rather than the whole text's.

use std::io::Write;

use anyhow::Result;

pub struct TextStream<D, W> {
    decode: D,
    out: W,
    tokens: Vec<i32>,
    /// Where the window of tokens not wholly printed starts; the token before it is decoded
    /// with it for context.
    start: usize,
    /// The window's text printed so far.
    printed: String,
}

impl<D: Fn(&[i32]) -> Result<String>, W: Write> TextStream<D, W> {
    /// Prints the prompt's text.
    pub fn start(decode: D, mut out: W, prompt: &[i32]) -> Result<Self> {
        write!(out, "{}", decode(prompt)?)?;
        out.flush()?;
        Ok(Self::reply(decode, out, prompt))
    }

    /// Prints nothing of the prompt: only what follows it (a chat model's reply).
    pub fn reply(decode: D, out: W, prompt: &[i32]) -> Self {
        TextStream {
            decode,
            out,
            tokens: prompt.to_vec(),
            start: prompt.len(),
            printed: String::new(),
        }
    }

    /// Prints what `token` completes.
    pub fn push(&mut self, token: i32) -> Result<()> {
        self.tokens.push(token);
        let text = self.window_text()?;
        let ready = text.trim_end_matches('\u{FFFD}');
        self.print_up_to(ready)?;
        if ready.len() == text.len() && text.ends_with('\n') {
            self.start = self.tokens.len();
            self.printed.clear();
        }
        Ok(())
    }

    /// Prints the rest, an unfinished character included, and ends the line.
    pub fn finish(mut self) -> Result<()> {
        let text = self.window_text()?;
        self.print_up_to(&text)?;
        writeln!(self.out)?;
        Ok(self.out.flush()?)
    }

    /// The text of the window's tokens.
    fn window_text(&self) -> Result<String> {
        let context = self.start.saturating_sub(1);
        let head = (self.decode)(&self.tokens[context..self.start])?;
        let text = (self.decode)(&self.tokens[context..])?;
        Ok(match text.strip_prefix(&head) {
            Some(rest) => rest.to_string(),
            None => text,
        })
    }

    /// Prints the part of `text` beyond what was printed, if `text` extends it (a decoder
    /// that rewrote earlier text leaves the window as printed).
    fn print_up_to(&mut self, text: &str) -> Result<()> {
        if let Some(new) = text.strip_prefix(self.printed.as_str()) {
            write!(self.out, "{new}")?;
            self.out.flush()?;
            self.printed = text.to_string();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(tokens: &[i32]) -> Result<String> {
        let b: Vec<u8> = tokens.iter().map(|&t| t as u8).collect();
        Ok(String::from_utf8_lossy(&b).into_owned())
    }

    /// What the stream prints for `text`'s bytes as tokens, the first `prompt` of them the
    /// prompt, and the prints after each token.
    fn stream(text: &str, prompt: usize) -> (String, Vec<String>) {
        let tokens: Vec<i32> = text.bytes().map(i32::from).collect();
        let mut out = vec![];
        let mut steps = vec![];
        let mut s = TextStream::start(bytes, &mut out, &tokens[..prompt]).unwrap();
        for &t in &tokens[prompt..] {
            s.push(t).unwrap();
            steps.push(String::from_utf8(s.out.clone()).unwrap());
        }
        s.finish().unwrap();
        (String::from_utf8(out).unwrap(), steps)
    }

    #[test]
    fn the_stream_prints_the_whole_text_once_and_never_half_a_character() {
        let text = "fn main() {\n    héllo wörld 你好\n}\n👋";
        for prompt in [1, 3, 14] {
            let (printed, steps) = stream(text, prompt);
            assert_eq!(printed, format!("{text}\n"), "prompt of {prompt} bytes");
            for s in &steps {
                assert!(!s.contains('\u{FFFD}'), "{s:?}");
                assert!(text.starts_with(s.as_str()), "{s:?}");
            }
        }
        // The last character's first bytes print nothing until its last one comes.
        let (_, steps) = stream("a👋", 1);
        assert_eq!(steps, ["a", "a", "a", "a👋"]);
    }

    #[test]
    fn an_unfinished_character_is_printed_at_the_end() {
        let tokens = [104, 105, 0xE4, 0xBD];
        let mut out = vec![];
        let mut s = TextStream::start(bytes, &mut out, &tokens[..1]).unwrap();
        for &t in &tokens[1..] {
            s.push(t).unwrap();
        }
        s.finish().unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "hi\u{FFFD}\n");
    }
}
