//! KV-cache layout and accounting, shared by every backend.
//!
//! Sliding layers keep a ring of `window` entries per sequence (slot = position mod window);
//! full layers grow with the sequence, up to the served context. Backends own the memory;
//! this module decides how much there is and which positions are still held.

use crate::config::{LayerType, ModelConfig};
use crate::dtype::DType;

/// How one layer's cache is laid out for one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvKind {
    /// A ring of `window` slots: position `p` lives in slot `p % window`.
    Ring { window: usize },
    /// Grows with the sequence, at most `max` positions.
    Grow { max: usize },
}

/// What a backend needs to allocate one layer's cache for one sequence.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvSpec {
    pub kind: KvKind,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub dtype: DType,
}

impl KvSpec {
    /// The layout for `layer_type` of `cfg`, serving contexts up to `ctx`.
    pub fn for_layer(cfg: &ModelConfig, t: LayerType, ctx: usize, dtype: DType) -> KvSpec {
        let kind = match t {
            LayerType::Sliding => KvKind::Ring { window: cfg.sliding_window.min(ctx) },
            LayerType::Full => KvKind::Grow { max: ctx },
        };
        KvSpec { kind, kv_heads: cfg.n_kv_heads, head_dim: cfg.head_dim, dtype }
    }

    /// Positions held for a sequence of `len` tokens.
    pub fn held(&self, len: usize) -> usize {
        match self.kind {
            KvKind::Ring { window } => len.min(window),
            KvKind::Grow { .. } => len,
        }
    }

    /// Bytes of K and V for one position.
    pub fn bytes_per_position(&self) -> usize {
        2 * self.kv_heads * self.head_dim * self.dtype.size()
    }

    /// Whether a cache holding `len` positions can be cut back to `new_len` and still serve
    /// position `new_len` next: a ring has dropped older positions.
    pub fn can_truncate(&self, len: usize, new_len: usize) -> bool {
        if new_len >= len || new_len == 0 {
            return true;
        }
        match self.kind {
            KvKind::Grow { .. } => true,
            // Held: [len - window, len). Needed for the next query at new_len: [new_len - window + 1, new_len).
            KvKind::Ring { window } => len <= window || new_len + 1 >= len,
        }
    }
}

/// KV memory of a whole sequence at length `len`, in bytes.
pub fn sequence_kv_bytes(cfg: &ModelConfig, ctx: usize, dtype: DType, len: usize) -> usize {
    cfg.layer_types
        .iter()
        .map(|&t| {
            let s = KvSpec::for_layer(cfg, t, ctx, dtype);
            s.held(len) * s.bytes_per_position()
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ring_truncation() {
        let s = KvSpec { kind: KvKind::Ring { window: 4 }, kv_heads: 1, head_dim: 2, dtype: DType::F32 };
        assert!(s.can_truncate(10, 9));
        assert!(!s.can_truncate(10, 8));
        assert!(s.can_truncate(3, 1)); // nothing evicted yet
        assert!(s.can_truncate(10, 0));
        assert_eq!(s.held(10), 4);
        let g = KvSpec { kind: KvKind::Grow { max: 100 }, ..s };
        assert!(g.can_truncate(50, 3));
        assert_eq!(g.held(10), 10);
    }
}
