from controlplane.cli.main import main

raise SystemExit(main())
