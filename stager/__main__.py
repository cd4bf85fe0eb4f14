from stager.cli import main

main()
