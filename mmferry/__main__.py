from mmferry.cli import main

raise SystemExit(main())
