//! What a rebuild of the actors reads and reports: where the weights come from again
//! ([`WeightSource`]) and how long each phase took ([`HealTimings`]). The supervisor rebuilds
//! (`SupState::heal` in `recovery`); when to rebuild is the decoding engine's policy
//! (`nsactor-decoding`'s heal).

pub use nsactor_checkpoint::source::WeightSource;

/// How long a rebuild took, by phase, and how long decoding was away.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct HealTimings {
    /// From the moment the stage was found lost (before any session was answered) until
    /// decoding served again: the phases below and the messages between them.
    pub away_s: f64,
    /// Reading the weights again from their source (a checkpoint: read and verified).
    pub read_s: f64,
    /// Stopping every actor and spawning new ones over freshly opened stages.
    pub rebuild_s: f64,
    /// Loading the weights into the new stages.
    pub load_s: f64,
}

impl HealTimings {
    /// The phases' sum.
    pub fn total_s(&self) -> f64 {
        self.read_s + self.rebuild_s + self.load_s
    }
}
