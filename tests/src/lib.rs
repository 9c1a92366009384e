//! End-to-end tests that cross crates: the `nsactor` command line and the workspace's
//! dependency direction (DESIGN "Workspace layout"). The tests live in `tests/tests/`; this
//! library is empty on purpose and depends on nothing.
