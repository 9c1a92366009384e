//! Which inputs the next cohort takes: the oldest waiting input's length (and kind: every
//! position's logits or the last's), except that prompt cohorts and decoding steps take turns.
//! After a cohort of prompts, the steps waiting go first, though prompts queued before them
//! are older. A burst of prompts (256 clients at once) otherwise ran every prompt cohort
//! before any step, and a stream's first token (its prompt's last input, fed as a step)
//! waited for all of them: every client's first token came at the end of the burst (s69).

use super::Waiting;
use std::collections::VecDeque;

/// The input length and kind of the next cohort, from `waiting` (not empty), given whether
/// the last cohort launched was of prompts.
pub(super) fn next_input(waiting: &VecDeque<Waiting>, after_prompts: bool) -> (usize, bool) {
    let front = waiting.front().expect("non-empty");
    let (len, every) = (front.ids.len(), front.reply.every());
    let steps_wait = || waiting.iter().any(|w| w.ids.len() == 1 && !w.reply.every());
    if after_prompts && len > 1 && steps_wait() {
        (1, false)
    } else {
        (len, every)
    }
}
