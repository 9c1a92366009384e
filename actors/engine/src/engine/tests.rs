//! Generation through [`StagedModel`] on the embedded CPU backend: suppressed tokens and eos.

use super::*;

fn tiny() -> StagedModel {
    let backend = crate::backend::open(crate::backend::EMBEDDED, &[]).unwrap();
    StagedModel::open(
        backend,
        &crate::config::tiny_model(),
        3,
        OptimizerKind::Adam,
        None,
    )
    .unwrap()
}

#[test]
fn suppressed_tokens_are_never_generated_and_eos_stops() {
    let mut m = tiny();
    let prompt = [3, 17, 42];
    let free = m.generate_greedy(&prompt, 6, None, &[]).unwrap();
    assert_eq!(free.len(), prompt.len() + 6);
    let generated: Vec<i64> = free[prompt.len()..].to_vec();
    let banned = vec![generated[0]];
    let out = m.generate_greedy(&prompt, 6, None, &banned).unwrap();
    assert!(
        out[prompt.len()..].iter().all(|t| !banned.contains(t)),
        "{out:?} contains {banned:?}"
    );
    assert_ne!(out[prompt.len()], generated[0]);
    // Stopping: with the first free token as eos, generation ends right after it.
    let stopped = m
        .generate_greedy(&prompt, 6, Some(generated[0]), &[])
        .unwrap();
    assert_eq!(stopped, [&prompt[..], &generated[..1]].concat());
}
