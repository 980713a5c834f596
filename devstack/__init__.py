"""The checkout's development stack and commands: the embedded Temporal dev server and Postgres
(devstack.embedded), and `python -m devstack` (also `./dev`): `up`, `down`, `seed`, `demo` and
`harness`. Not installed: the installed `deadline-cleanup` command never imports it."""
