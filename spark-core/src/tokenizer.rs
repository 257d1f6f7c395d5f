//! The tokenizer: a `tokenizer.json` (Hugging Face tokenizers format; Spark-X2.5 uses a
//! byte-level BPE with digits split one per token) behind a small API.
//!
//! - [`Tokenizer`]: encode without adding BOS/EOS (the chat template writes them; added
//!   tokens such as `<|User|>` written in the text still become their ids), decode, id/token
//!   lookups, and the Spark special ids looked up by content ([`SpecialIds`]).
//! - [`StreamDecoder`]: turns generated ids, one at a time, into text deltas; a character
//!   split over several byte-level tokens is held back until it is complete.

use std::path::Path;

use anyhow::{anyhow, Context, Result};

/// Contents of the Spark-X2.5 special and marker tokens.
pub mod tokens {
    /// Beginning of sentence; opens every turn.
    pub const BOS: &str = "<｜start▁of▁sentence｜>";
    /// End of sentence; closes every turn and ends generation.
    pub const EOS: &str = "<｜end▁of▁sentence｜>";
    /// Padding.
    pub const PAD: &str = "<｜▁pad▁｜>";
    pub const THINK: &str = "<think>";
    pub const END_THINK: &str = "</think>";
    pub const SYSTEM: &str = "<|System|>";
    pub const USER: &str = "<|User|>";
    pub const TOOL: &str = "<|Tool|>";
    pub const DEVELOPER: &str = "<|Developer|>";
    pub const BOT: &str = "<|Bot|>";
    pub const TOOL_CALL: &str = "<tool_call>";
    pub const END_TOOL_CALL: &str = "</tool_call>";
    pub const TOOL_RESPONSE: &str = "<tool_response>";
    pub const END_TOOL_RESPONSE: &str = "</tool_response>";
    pub const ARG_KEY: &str = "<arg_key>";
    pub const END_ARG_KEY: &str = "</arg_key>";
    pub const ARG_VALUE: &str = "<arg_value>";
    pub const END_ARG_VALUE: &str = "</arg_value>";
}

/// Ids of the Spark special and marker tokens in one tokenizer (`None` where it lacks one).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SpecialIds {
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub pad: Option<u32>,
    pub think: Option<u32>,
    pub end_think: Option<u32>,
    pub system: Option<u32>,
    pub user: Option<u32>,
    pub tool: Option<u32>,
    pub developer: Option<u32>,
    pub bot: Option<u32>,
    pub tool_call: Option<u32>,
    pub end_tool_call: Option<u32>,
    pub tool_response: Option<u32>,
    pub end_tool_response: Option<u32>,
    pub arg_key: Option<u32>,
    pub end_arg_key: Option<u32>,
    pub arg_value: Option<u32>,
    pub end_arg_value: Option<u32>,
}

/// A loaded `tokenizer.json`.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    special: SpecialIds,
    vocab_size: usize,
    origin: String,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("origin", &self.origin)
            .field("vocab_size", &self.vocab_size)
            .field("special", &self.special)
            .finish()
    }
}

impl Tokenizer {
    /// Loads a `tokenizer.json`; errors name the file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).with_context(|| format!("reading tokenizer {}", path.display()))?;
        let inner = tokenizers::Tokenizer::from_bytes(&bytes)
            .map_err(|e| anyhow!("parsing tokenizer {}: {e}", path.display()))?;
        Ok(Self::from_inner(inner, path.display().to_string()))
    }

    /// Loads `tokenizer.json` from a model directory.
    pub fn from_model_dir(dir: impl AsRef<Path>) -> Result<Self> {
        Self::from_file(dir.as_ref().join("tokenizer.json"))
    }

    /// Wraps an already built `tokenizers::Tokenizer`.
    pub fn from_inner(inner: tokenizers::Tokenizer, origin: impl Into<String>) -> Self {
        let vocab_size = inner.get_vocab(true).values().max().map_or(0, |&max| max as usize + 1);
        let id = |content: &str| inner.token_to_id(content);
        let special = SpecialIds {
            bos: id(tokens::BOS),
            eos: id(tokens::EOS),
            pad: id(tokens::PAD),
            think: id(tokens::THINK),
            end_think: id(tokens::END_THINK),
            system: id(tokens::SYSTEM),
            user: id(tokens::USER),
            tool: id(tokens::TOOL),
            developer: id(tokens::DEVELOPER),
            bot: id(tokens::BOT),
            tool_call: id(tokens::TOOL_CALL),
            end_tool_call: id(tokens::END_TOOL_CALL),
            tool_response: id(tokens::TOOL_RESPONSE),
            end_tool_response: id(tokens::END_TOOL_RESPONSE),
            arg_key: id(tokens::ARG_KEY),
            end_arg_key: id(tokens::END_ARG_KEY),
            arg_value: id(tokens::ARG_VALUE),
            end_arg_value: id(tokens::END_ARG_VALUE),
        };
        Tokenizer { inner, special, vocab_size, origin: origin.into() }
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }

    /// Where the tokenizer was loaded from.
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// Text to ids. Adds no BOS/EOS; added tokens written in the text (`<|User|>`,
    /// `<think>`, `<｜end▁of▁sentence｜>`) become their ids.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding =
            self.inner.encode(text, false).map_err(|e| anyhow!("encoding with tokenizer {}: {e}", self.origin))?;
        Ok(encoding.get_ids().to_vec())
    }

    /// Ids to text. `skip_special` drops tokens flagged special (BOS, EOS, pad); role, think
    /// and tool markers are not special and stay. Unknown ids are skipped.
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String> {
        self.inner.decode(ids, skip_special).map_err(|e| anyhow!("decoding with tokenizer {}: {e}", self.origin))
    }

    /// A decoder for streaming generated ids as text deltas.
    pub fn stream_decoder(&self, skip_special: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special)
    }

    /// The id of a token (vocabulary or added token) by its content.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The content of a token (byte-level form for vocabulary tokens, e.g. `Ġthe`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The bytes a token stands for in text: an added token's content, a byte-level vocabulary
    /// token's bytes (which may be part of a UTF-8 character). `None` for special tokens (they
    /// are not text) and unknown ids.
    pub fn token_bytes(&self, id: u32) -> Option<Vec<u8>> {
        let added = self.inner.get_added_vocabulary();
        if let Some(t) = added.simple_id_to_token(id) {
            return (!added.is_special_token(&t)).then(|| t.into_bytes());
        }
        let piece = self.inner.id_to_token(id)?;
        let bytes: Option<Vec<u8>> = piece.chars().map(byte_of_char).collect();
        // Not a byte-level vocabulary: the token's text as decoded.
        bytes.or_else(|| self.inner.decode(&[id], false).ok().map(String::into_bytes))
    }

    /// One past the largest id, added tokens included (the number of tokens when ids have
    /// no gaps).
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Whether `id` is an added token flagged special (skipped by skip-special decoding).
    pub fn is_special(&self, id: u32) -> bool {
        self.inner
            .get_added_vocabulary()
            .simple_id_to_token(id)
            .is_some_and(|t| self.inner.get_added_vocabulary().is_special_token(&t))
    }

    /// The Spark special and marker ids, looked up by content.
    pub fn special_ids(&self) -> &SpecialIds {
        &self.special
    }

    /// `<｜start▁of▁sentence｜>`.
    pub fn bos_id(&self) -> Option<u32> {
        self.special.bos
    }

    /// `<｜end▁of▁sentence｜>`, which ends every turn.
    pub fn eos_id(&self) -> Option<u32> {
        self.special.eos
    }

    /// `<｜▁pad▁｜>`.
    pub fn pad_id(&self) -> Option<u32> {
        self.special.pad
    }
}

/// The byte a byte-level BPE character stands for (GPT-2's `bytes_to_unicode`, inverted):
/// printable Latin-1 bytes are themselves, the other 68 bytes map to U+0100.. in order.
fn byte_of_char(c: char) -> Option<u8> {
    static TABLE: std::sync::OnceLock<[Option<u8>; 324]> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        let printable =
            |b: usize| (0x21..=0x7e).contains(&b) || (0xa1..=0xac).contains(&b) || (0xae..=0xff).contains(&b);
        let mut t = [None; 324];
        let mut next = 256;
        for b in 0..256usize {
            if printable(b) {
                t[b] = Some(b as u8);
            } else {
                t[next] = Some(b as u8);
                next += 1;
            }
        }
        t
    });
    table.get(c as usize).copied().flatten()
}

/// Incremental decoding of a stream of ids into text deltas.
///
/// Each [`step`](Self::step) returns the text that became final with that id, or `None`
/// while the pending ids do not yet end on a complete character (a multi-byte UTF-8
/// character split over several byte-level tokens): no U+FFFD is emitted for a partial
/// sequence. [`flush`](Self::flush) returns what is left at the end of the stream (with
/// U+FFFD for bytes that never formed a character, as a full decode would). The deltas of
/// all steps plus the flush concatenate to `decode(all ids)`.
///
/// The pending ids are decoded together with the ids of the last emitted delta, so decoders
/// whose output depends on neighbouring tokens (e.g. leading-space handling) stay correct.
#[derive(Debug)]
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special: bool,
    /// Context ids (`ids[..read]`, already emitted) followed by pending ids.
    ids: Vec<u32>,
    read: usize,
    /// `decode(ids[..read])`.
    prefix: String,
}

impl<'a> StreamDecoder<'a> {
    /// A decoder over `tokenizer`; `skip_special` as in [`Tokenizer::decode`].
    pub fn new(tokenizer: &'a Tokenizer, skip_special: bool) -> Self {
        StreamDecoder { tokenizer, skip_special, ids: Vec::new(), read: 0, prefix: String::new() }
    }

    /// Adds one id; returns the newly completed text, if any.
    pub fn step(&mut self, id: u32) -> Result<Option<String>> {
        self.ids.push(id);
        let text = self.tokenizer.decode(&self.ids, self.skip_special)?;
        if text.len() <= self.prefix.len() || text.ends_with('\u{FFFD}') {
            return Ok(None);
        }
        let delta = text_after(&self.prefix, &text);
        // The pending ids become the context of the next window.
        self.ids.drain(..self.read);
        self.read = self.ids.len();
        self.prefix = self.tokenizer.decode(&self.ids, self.skip_special)?;
        Ok(Some(delta))
    }

    /// Adds several ids; returns the concatenated completed text (possibly empty).
    pub fn step_many(&mut self, ids: &[u32]) -> Result<String> {
        let mut out = String::new();
        for &id in ids {
            if let Some(delta) = self.step(id)? {
                out.push_str(&delta);
            }
        }
        Ok(out)
    }

    /// Ends the stream: returns the text of the still pending ids, if any, and resets.
    pub fn flush(&mut self) -> Result<Option<String>> {
        let delta = if self.read < self.ids.len() {
            let text = self.tokenizer.decode(&self.ids, self.skip_special)?;
            Some(text_after(&self.prefix, &text)).filter(|d| !d.is_empty())
        } else {
            None
        };
        self.ids.clear();
        self.read = 0;
        self.prefix.clear();
        Ok(delta)
    }

    /// Whether ids are held back waiting for the rest of a character.
    pub fn has_pending(&self) -> bool {
        self.read < self.ids.len()
    }
}

/// `text` without `prefix`; if a decoder rewrote the prefix, the part after the longest
/// common prefix (never splitting a character).
fn text_after(prefix: &str, text: &str) -> String {
    if let Some(rest) = text.strip_prefix(prefix) {
        return rest.to_string();
    }
    let common = prefix
        .char_indices()
        .zip(text.chars())
        .find(|((_, a), b)| a != b)
        .map_or(prefix.len().min(text.len()), |((i, _), _)| i);
    text.get(common..).unwrap_or_default().to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn token_bytes_spell_the_text() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/spark-demo-tiny");
        let tok = Tokenizer::from_model_dir(&dir).unwrap();
        for text in ["naïve café — 東京 {\"a\": [1, 2.5e-3]}\n\ttabs", "  two spaces\r\n", "<tool_call>x</tool_call>"]
        {
            let ids = tok.encode(text).unwrap();
            let bytes: Vec<u8> = ids.iter().flat_map(|&i| tok.token_bytes(i).unwrap()).collect();
            assert_eq!(String::from_utf8(bytes).unwrap(), text);
        }
        assert_eq!(tok.token_bytes(tok.eos_id().unwrap()), None);
        assert_eq!(tok.token_bytes(1 << 30), None);
        // Every vocabulary token has bytes.
        assert!((0..tok.vocab_size() as u32).filter(|&i| !tok.is_special(i)).all(|i| tok.token_bytes(i).is_some()));
    }

    #[test]
    fn text_after_handles_rewritten_prefix() {
        assert_eq!(text_after("ab", "abc"), "c");
        assert_eq!(text_after("aé", "aöx"), "öx");
        assert_eq!(text_after("abc", "ab"), "");
    }
}
