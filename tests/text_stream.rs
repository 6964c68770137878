//! `smelt sample`'s text stream on the real Qwen2.5 tokenizer (`.ci/fetch-assets`): printed
//! piece by piece as the tokens come, it adds up to the tokenizer's decoding of them all, and
//! no piece shows half a character, though byte-level BPE splits characters across tokens.

mod tokenizing;

use std::cell::RefCell;
use std::io::Write;
use std::rc::Rc;

use smelt::generate::TextStream;
use tokenizing::*;

/// A writer whose bytes the test reads while the stream holds it.
#[derive(Clone, Default)]
struct Shared(Rc<RefCell<Vec<u8>>>);

impl Write for Shared {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.borrow_mut().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Shared {
    fn text(&self) -> String {
        String::from_utf8(self.0.borrow().clone()).unwrap()
    }
}

#[test]
fn streamed_text_adds_up_to_the_tokenizers_decoding() {
    let play = std::fs::read_to_string(&plays()[0]).unwrap();
    let play: String = play.chars().take(4000).collect();
    let texts: Vec<&str> = TRICKY.into_iter().chain([play.as_str()]).collect();
    let decode = |ids: &[i32]| Ok(decode(ids));
    for text in texts {
        let ids: Vec<i32> = (tokenizer().encode(text, false).unwrap().get_ids().iter())
            .map(|&id| id as i32)
            .collect();
        // A character split over tokens: the stream must wait for its last one.
        let split = ids
            .iter()
            .any(|&id| decode(&[id]).unwrap().contains('\u{FFFD}'));
        for prompt in [1, ids.len() / 2] {
            let out = Shared::default();
            let mut stream = TextStream::start(decode, out.clone(), &ids[..prompt]).unwrap();
            for &id in &ids[prompt..] {
                stream.push(id).unwrap();
                let shown = out.text();
                assert!(
                    text.starts_with(&shown),
                    "{shown:?} is not a start of {text:?}"
                );
            }
            stream.finish().unwrap();
            assert_eq!(out.text(), format!("{text}\n"), "prompt of {prompt} tokens");
        }
        if text.contains('🚀') {
            assert!(split, "{text:?}: no token holds part of a character");
        }
    }
}
