from gpuport.cli._agent import main

main()
