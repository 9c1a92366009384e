//! Batch invariance of decoding on the CPU backend (issue 29): the same prompt decoded alone
//! and inside cohorts of 3 and 17 sessions with other prompts gives the same tokens and
//! bit-identical logits at every step.

use nsactor_decoding::invariance;
use nsactor_engine::backend::{self, EMBEDDED};
use nsactor_engine::config::tiny_model;

#[test]
fn a_session_decodes_bit_identically_alone_and_in_cohorts_of_3_and_17() {
    let compute = backend::open(EMBEDDED, &[]).unwrap();
    let model = tiny_model();
    let steps = 12;
    let checks = invariance::check(compute.clone(), &model, 11, &[3, 17], steps).unwrap();
    assert_eq!(checks.len(), 2);
    for c in &checks {
        assert_eq!(c.logits, steps * model.vocab_size, "{c:?}");
        assert!(c.invariant(), "{c:?}");
        assert_eq!(c.picks_differing, 0, "{c:?}");
    }
    // The comparison sees a different model (another seed) as different.
    let ours = vec![5, 6, 7, 8, 9, 10];
    let a = invariance::decode_cohort(compute.clone(), &model, 11, std::slice::from_ref(&ours), 2)
        .unwrap();
    let b = invariance::decode_cohort(compute, &model, 12, std::slice::from_ref(&ours), 2).unwrap();
    assert_ne!(a, b);
}
