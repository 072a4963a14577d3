"""The report from a run directory alone (`report`: report.md, report.json, report.csv, plots), its
"Where the time goes" section (`breakdown`), the projection to device counts not run (`projection`),
and the trace server (`trace`). Reads files only; never imports jax or torch, so it runs on a login
node."""
