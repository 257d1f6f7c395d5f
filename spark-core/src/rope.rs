//! Rotary position tables, one per layer type, sized to the context actually served.
//!
//! NeoX (rotate-half) style over the first `rot_dims` dims of each head, with
//! `inv_freq[j] = theta^(-2j/rot_dims)` computed in f32 as the reference does.

use crate::config::RopeParams;

/// cos/sin for positions `0..positions`, each row `rot_dims / 2` wide.
#[derive(Clone, Debug)]
pub struct RopeTable {
    pub rot_dims: usize,
    pub positions: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

impl RopeTable {
    /// Build the table for `positions` positions (the served context, not
    /// `max_position_embeddings`).
    pub fn new(params: RopeParams, positions: usize) -> RopeTable {
        let half = params.rot_dims / 2;
        let theta = params.theta as f32;
        let inv_freq: Vec<f32> =
            (0..half).map(|j| 1.0f32 / theta.powf((2 * j) as f32 / params.rot_dims as f32)).collect();
        let mut cos = Vec::with_capacity(positions * half);
        let mut sin = Vec::with_capacity(positions * half);
        for p in 0..positions {
            for &f in &inv_freq {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        RopeTable { rot_dims: params.rot_dims, positions, cos, sin }
    }

    /// Bytes held by the table.
    pub fn bytes(&self) -> usize {
        (self.cos.len() + self.sin.len()) * 4
    }
}
