//! The tokenizer on the demo checkpoint's real `tokenizer.json`: round trips, digit
//! splitting, added tokens, streaming decode of multi-byte text, load errors.

use std::path::{Path, PathBuf};

use anyhow::Result;
use spark_core::tokenizer::Tokenizer;

fn demo_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from(".."))
        .join("models/spark-demo-tiny")
}

fn demo() -> Result<Tokenizer> {
    Tokenizer::from_file(demo_dir().join("tokenizer.json"))
}

const SAMPLES: &[&str] = &[
    "Hello, world!",
    "héllo wörld ✓ 日本",
    "emoji 😀👍🏽 and ümlauts, çà, Ελληνικά, русский, 中文字符",
    "  leading spaces\n\ttabs and newlines\r\n",
    "year 2026: 3.14159",
];

#[test]
fn round_trip() -> Result<()> {
    let tok = demo()?;
    for text in SAMPLES {
        let ids = tok.encode(text)?;
        assert!(!ids.is_empty());
        assert_eq!(&tok.decode(&ids, false)?, text, "ids {ids:?}");
        assert_eq!(&tok.decode(&ids, true)?, text);
    }
    assert_eq!(tok.encode("")?, Vec::<u32>::new());
    Ok(())
}

#[test]
fn digits_split_one_per_token_and_no_bos() -> Result<()> {
    let tok = demo()?;
    let ids = tok.encode("2026")?;
    assert_eq!(ids.len(), 4, "{ids:?}");
    let pieces: Vec<String> = ids.iter().map(|&id| tok.decode(&[id], false)).collect::<Result<_>>()?;
    assert_eq!(pieces, ["2", "0", "2", "6"]);
    assert!(!ids.contains(&0) && !ids.contains(&1));
    Ok(())
}

#[test]
fn added_tokens_map_to_their_ids() -> Result<()> {
    let tok = demo()?;
    assert_eq!(tok.token_to_id("<|User|>"), Some(4084));
    assert_eq!(tok.token_to_id("<think>"), Some(3));
    assert_eq!(tok.id_to_token(4084).as_deref(), Some("<|User|>"));
    assert_eq!(tok.vocab_size(), 4096);

    let ids = tok.encode("<|User|>Hi<think>")?;
    assert_eq!(ids.first(), Some(&4084));
    assert_eq!(ids.last(), Some(&3));
    assert!(ids.len() >= 3);

    let special = tok.special_ids();
    assert_eq!(tok.bos_id(), Some(0));
    assert_eq!(tok.eos_id(), Some(1));
    assert_eq!(tok.pad_id(), Some(2));
    assert_eq!(special.end_think, Some(4));
    assert_eq!(special.system, Some(4083));
    assert_eq!(special.bot, Some(4087));
    assert_eq!(special.end_tool_call, Some(4095));
    assert!(tok.is_special(1) && !tok.is_special(4084));

    // A whole rendered turn: BOS/EOS are special (skipped), role and think markers are not.
    let text = "<｜start▁of▁sentence｜><|User|>Hi<｜end▁of▁sentence｜><｜start▁of▁sentence｜><|Bot|><think>";
    let ids = tok.encode(text)?;
    assert_eq!(ids[..2], [0, 4084]);
    assert_eq!(tok.decode(&ids, false)?, text);
    assert_eq!(tok.decode(&ids, true)?, "<|User|>Hi<|Bot|><think>");
    Ok(())
}

#[test]
fn stream_decoder_reproduces_full_decode() -> Result<()> {
    let tok = demo()?;
    for text in SAMPLES {
        let ids = tok.encode(text)?;
        let full = tok.decode(&ids, false)?;
        let mut stream = tok.stream_decoder(false);
        let mut out = String::new();
        let mut held_back = 0;
        for &id in &ids {
            match stream.step(id)? {
                Some(delta) => {
                    assert!(!delta.contains('\u{FFFD}'), "partial char emitted for {text:?}");
                    out.push_str(&delta);
                }
                None => held_back += 1,
            }
        }
        if let Some(rest) = stream.flush()? {
            out.push_str(&rest);
        }
        assert_eq!(out, full);
        if !text.is_ascii() && ids.len() > text.chars().count() {
            // Some character spans several tokens, so something was held back.
            assert!(held_back > 0, "{text:?}");
        }
    }
    Ok(())
}

#[test]
fn stream_decoder_holds_partial_characters() -> Result<()> {
    let tok = demo()?;
    // Find a character that this small vocabulary splits over several byte tokens.
    let text = "日本語の文字";
    let ids = tok.encode(text)?;
    assert!(ids.len() > text.chars().count(), "expected byte-split characters: {ids:?}");
    let mut stream = tok.stream_decoder(true);
    let mut out = String::new();
    for &id in &ids {
        if let Some(delta) = stream.step(id)? {
            assert!(delta.chars().all(|c| text.contains(c)), "{delta:?}");
            out.push_str(&delta);
        }
    }
    assert!(!stream.has_pending());
    assert_eq!(stream.flush()?, None);
    assert_eq!(out, text);

    // A stream cut inside a character: nothing emitted for it, the flush gives U+FFFD like
    // a full decode.
    let mut stream = tok.stream_decoder(false);
    let first = ids[0];
    assert_eq!(stream.step(first)?, None);
    assert!(stream.has_pending());
    assert_eq!(stream.flush()?, Some(tok.decode(&[first], false)?));
    Ok(())
}

#[test]
fn missing_file_error_names_the_path() {
    let path = demo_dir().join("no-such-tokenizer.json");
    let err = Tokenizer::from_file(&path).err().map(|e| format!("{e:#}")).unwrap_or_default();
    assert!(err.contains("no-such-tokenizer.json"), "{err}");
    let dir = tempfile::tempdir().ok();
    if let Some(dir) = dir {
        let bad = dir.path().join("tokenizer.json");
        if std::fs::write(&bad, "{not json").is_ok() {
            let err = Tokenizer::from_file(&bad).err().map(|e| format!("{e:#}")).unwrap_or_default();
            assert!(err.contains(&bad.display().to_string()), "{err}");
        }
    }
}
